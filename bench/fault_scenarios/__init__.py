"""The scenarios of ``bench/faults.py``, one module each, over shared process helpers (``processes.py``)."""
