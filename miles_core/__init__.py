"""miles-flyte core: RL post-training building blocks (no Flyte imports here)."""

import os

from miles_core.cpus import thread_environment

__version__ = "0.2.0"

# Threads for the CPUs this process may use (its affinity and cgroup quota, not the machine's core count) and OpenMP
# threads that sleep rather than spin while waiting: set before torch starts OpenMP in this process (the workflow's
# modules import the core first) and inherited by every process it starts (Elastic workers, Ray, servers). A value
# the user set wins.
for _name, _value in thread_environment().items():
    os.environ.setdefault(_name, _value)
