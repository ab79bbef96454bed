"""``python -m outboxkit``: the ``outboxkit`` command (how ``run --processes`` starts children)."""

from outboxkit.cli import main

if __name__ == "__main__":
    main()
