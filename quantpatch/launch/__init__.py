"""Launching runs: the registry of models, datasets, profiles and schemes (``registry``),
the checkout's own Megatron arguments and release (``megatron_args``, ``megatron_release``,
``megatron_files``), layouts (``layout``), launch scripts for Megatron and ms-swift
(``scripts``, ``swift``, ``shell_render``, ``plan``), sweeps (``sweep``; its record,
``sweep_record``), and the data a
selection reads, checked before launch (``data_check``).

Imports: ``quantpatch.base``, ``quantpatch.sites``, ``quantpatch.git``,
``quantpatch.checkout``, ``quantpatch.data_prep`` (where the scripts' datasets are:
``data_check``)."""
