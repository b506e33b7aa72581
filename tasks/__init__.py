import tasks.literal_types  # noqa: F401 (before any task is declared: each dataclass's literal type built once)
