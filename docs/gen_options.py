"""Print the engine options table of docs/configuration.md from ``EngineArgs``' fields.

Each row is a field's Python name, its CLI flag(s) (as ``EngineArgs.add_cli_args`` makes them), its
default and its ``help`` metadata, so the table says exactly what ``--help`` says. Regenerate with

    .venv/bin/python docs/gen_options.py

and paste the output between the ``options table`` markers of docs/configuration.md.
"""

import dataclasses

from pagedllm.config import EngineArgs


def main() -> None:
    print("| option (Python) | CLI flag | default | meaning |")
    print("|---|---|---|---|")
    for option in dataclasses.fields(EngineArgs):
        flags = option.metadata.get("flags", ("--" + option.name.replace("_", "-"),))
        if option.type in (bool, "bool"):
            flags = tuple(f"{flag} / --no-{flag[2:]}" for flag in flags)
        choices = option.metadata.get("choices")
        meaning = option.metadata["help"].replace("|", "\\|")
        if choices:
            meaning += " (one of " + ", ".join(f"`{choice}`" for choice in choices) + ")"
        default = "not set" if option.default is None else f"`{option.default}`"
        print(f"| `{option.name}` | {', '.join(f'`{flag}`' for flag in flags)} | {default} | {meaning} |")


if __name__ == "__main__":
    main()
