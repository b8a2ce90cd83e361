"""Launching runs: the registry of models, datasets, profiles and schemes (``registry``),
the checkout's own Megatron arguments and release (``megatron_args``, ``megatron_release``,
``megatron_files``), layouts (``layout``), launch scripts for Megatron and ms-swift
(``scripts``, ``swift``, ``shell_render``, ``plan``) and sweeps (``sweep``).

Imports: ``quantpatch.base``, ``quantpatch.sites``, ``quantpatch.git``,
``quantpatch.checkout``."""
