"""``megatron.core.tensor_saver``: the tensor saver where a checkout's own callers import it.

Installed by ``quantpatch saver install`` as ``megatron/core/tensor_saver.py``; the saver
itself is ``megatron/core/quantpatch/tensor_saver.py`` (its API) and its parts in
``megatron/core/quantpatch/quantpatch_saver/``. Importing this module gives that very module
object (``sys.modules`` holds it under both names), so its settings and state are one:
``configure()``, ``ENABLED`` and every function read the same whichever name a caller used,
and a fork's ``from megatron.core.tensor_saver import get_tensor_saver`` keeps working.
``quantpatch saver remove`` puts back what was here before (a fork's own saver, or nothing).
"""

import importlib
import sys

# ``from .quantpatch import tensor_saver``, spelled so that the module reads the same from
# quantpatch's own source tree, where this file is not inside ``megatron.core``
sys.modules[__name__] = importlib.import_module(".quantpatch.tensor_saver", __package__)
