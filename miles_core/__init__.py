"""miles-flyte core: RL post-training building blocks (no Flyte imports here)."""

__version__ = "0.2.0"
