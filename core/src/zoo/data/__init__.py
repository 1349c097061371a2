"""Datasets: the embedded default corpus (`zoo.data.corpus`); Megatron indexed data comes next."""
