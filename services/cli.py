"""The `baton` command line.

Each subcommand lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their command runs, so `baton --help`
stays fast. Every flag can also be set through an environment variable: `--page-size`
of any command reads `BATON_PAGE_SIZE` as its default (flags win over the environment).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from baton.common import env
from baton.common.options import ConfigError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("baton.services.launcher", "start a local cluster: bootstrap, router, workers"),
    "bootstrap": ("baton.services.bootstrap.main", "run the membership registry"),
    "router": ("baton.services.router.main", "run the OpenAI-compatible router"),
    "worker": ("baton.services.worker.main", "run an aggregated worker (prefill + decode)"),
    "prefill": ("baton.services.worker.main", "run a prefill worker"),
    "decode": ("baton.services.worker.main", "run a decode worker"),
    "generate": ("baton.services.generate", "generate text offline with the engine"),
    "make-model": ("baton.common.models.tiny", "write a tiny random-weight HF model folder"),
    "bench": ("baton.benchmarks.cli", "load-test tools: `bench serve`, `bench pd-sweep`"),
    "top": ("baton.services.top", "a live view of a running cluster, from its router"),
    "planner": (
        "baton.services.planner.main",
        "change workers' roles (P:D) to meet the SLO, watching a running cluster's router",
    ),
}


class HelpFormatter(argparse.HelpFormatter):
    """Never wraps a line inside an `[env NAME]` hint, so the name reads (and greps) whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        glued = re.sub(r"\[env (\w+)\]", "[env\u00a0\\1]", text)
        return [line.replace("\u00a0", " ") for line in super()._split_lines(glued, width)]


def env_name(dest: str) -> str:
    return "BATON_" + dest.upper().replace("-", "_")


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Make BATON_<FLAG> the default of every flag of `parser` (recursively)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub)
            continue
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {env_name(action.dest)}]".strip()
        raw = os.environ.get(env_name(action.dest))
        if raw is None:
            continue
        switch = argparse._StoreTrueAction | argparse._StoreFalseAction
        if isinstance(action, switch | argparse.BooleanOptionalAction):
            value: object = raw.strip().lower() in ("1", "true", "yes", "on")
        elif action.type is not None and callable(action.type):
            try:
                value = action.type(raw)
            except (TypeError, ValueError) as e:
                parser.error(f"{env_name(action.dest)}={raw!r}: {e}")
        else:
            value = raw
        if action.choices is not None and value is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            parser.error(f"{env_name(action.dest)}={raw!r}: invalid choice (choose from {choices})")
        action.default = value
        action.required = False


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton",
        description="baton: disaggregated LLM serving",
        epilog=_environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        sub.set_defaults(_module=module_name)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
    return parser


def _environment_help() -> str:
    lines = ["environment: every flag --foo-bar of a command reads BATON_FOO_BAR; besides:"]
    lines += [f"  {var.name:26} {var.help}" for var in env.ALL]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:  # a value the typed configs refuse: name the flag, like argparse
        print(f"baton {args.command}: error: argument {e.flag or e.field}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
