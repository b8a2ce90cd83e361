"""The tensor saver's parts, one concern each; ``tensor_saver.py`` beside this package is the
API its callers use. Installed into a checkout as
``megatron/core/quantpatch/quantpatch_saver/``; torch and the standard library only.

``settings``      the ``TENSOR_SAVE_*`` variables, the rank, the source commit, the iteration
``capture``       what the training thread does: layer names, identity, snapshots, pools
``device_copy``   a CUDA tensor's statistics and copy to pinned memory on a side stream
``writer``        the pipeline: selection, naming, the statistics and writer threads, counts
``stats``         min, max, mean, std by torch's operators (on the device or the host)
``ondisk``        the file's bytes (``torch.save``'s) and how they are written
``dtypes``        what torch can copy, reduce and save for each dtype
``compat``        a fork's own saver's calling conventions
``stats_kernel``  accelerator: the one-pass C statistics kernel and its cache
``pickler``       accelerator: torch.save's legacy pickles without its per-object callbacks
"""
