"""The hooks a zoo plugin implements. Each docstring is the specification.

A plugin is a module (or object) named by an entry point in the ``zoo.plugins`` group::

    [project.entry-points."zoo.plugins"]
    mixer = "zoo_mixer_example.plugin"

Any function in it whose name starts with ``zoo_`` is taken as a hook implementation (the
`hookimpl` marker is optional and only needed for pluggy options such as ``tryfirst``). A
``zoo_``-prefixed function that matches no hook below, or whose parameters are not a subset of the
hook's, makes the plugin fail to register with an error naming it; the other plugins keep working.
The entry-point module must import quickly and must not import torch or model code: name heavy
objects with `zoo.family.Ref` strings instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from zoo.family import CommandSpec, DatasetSpec, Family

PROJECT = "zoo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def zoo_families() -> Sequence[Family]:
    """Return the model families this plugin provides.

    Each `zoo.Family` carries its name and aliases, flavors (a ``tiny`` one is required), config
    dataclass, named static layer specs, and lazy references to its build function, loss,
    example batch, checkpoint mappings and generation entry. Names must be unique across all
    installed plugins: two plugins claiming one name make that name unusable until one is
    removed, and the error names both distributions.
    """


@hookspec
def zoo_datasets() -> Sequence[DatasetSpec]:
    """Return the named datasets this plugin provides (a family's ``default_dataset`` refers to one).

    The dataset's ``build`` reference is resolved only when a run uses it.
    """


@hookspec
def zoo_commands() -> Sequence[CommandSpec]:
    """Return extra `zoo` sub-commands. Their names must not shadow the core's commands."""
