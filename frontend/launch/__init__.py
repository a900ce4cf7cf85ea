"""Starting a whole stack: as local processes under a supervisor (processes.py, supervisor.py) or
in one process (local_stack.py), from one description (config.py), secured by security.py."""
