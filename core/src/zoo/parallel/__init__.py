"""The parallel core: process grid with named axes, communication primitives, tensor parallel layers."""
