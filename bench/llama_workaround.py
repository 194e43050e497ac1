"""llama.cpp with its extra buffer types (weight repacking) off, for every bench that runs it.

On this machine's Xeon (AMX) llama-cpp-python 0.3.36 segfaults in ``llama_decode`` with them on,
for the plain ``Llama`` API and ``llama_cpp.server`` alike (measured 2026-12-03); off, it runs.
Imported by code running in the llama-cpp-python interpreter, so it needs nothing but llama_cpp.
"""


def disable_extra_buffer_types() -> None:
    """Make every later ``Llama(...)`` load its model with ``use_extra_bufts = False``."""
    import llama_cpp.llama_cpp as low

    defaults = low.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
