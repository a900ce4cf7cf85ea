"""The one-call GPU check (bench/gpu_check.sh) and the modules its sections run.

Run each as a module from the checkout (``python -m bench.gpu.NAME``): ``imports`` (what the
sections import, found by importing), ``preflight`` (the environment in seconds), ``image_venv``
(the GPU image's interpreter for a CPU rehearsal), ``worker_check``, ``pd_check`` and ``mps``.
"""
