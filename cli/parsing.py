"""The command line's argparse pieces: one-line argument errors, the cluster options every client
command takes, --version looked up only when asked, and a parser that builds only the command
given (cli/main.py builds the commands with them)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn


# Characters that would break a one-line error in two (str.splitlines' line boundaries).
_LINE_BREAKS = re.compile("[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]")


def _one_line(message: str) -> str:
    return _LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], message)


def _fail(message: str) -> NoReturn:
    """An argument error: one line on stderr, exit status 2."""
    print(f"revenant: {_one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other error (no usage block)."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see {self.prog} --help)")


def _add_cluster_args(p: argparse.ArgumentParser, timeout: float = 5.0) -> None:
    p.add_argument("--dir", help="cluster directory written by 'revenant up' (reads its cluster.json)")
    p.add_argument("--nats", help="NATS URL of the cluster (default: $REVENANT_NATS)")
    p.add_argument("--creds", help="NATS credential file, named <identity>.nk (default: --dir's, then "
                   "$REVENANT_CREDS)")
    p.add_argument("--timeout", type=float, default=timeout, help=f"seconds to wait for a reply (default {timeout:g})")


class _Version(argparse.Action):
    """--version, its look-up (package metadata) done only when asked."""

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        from revenant.common.version import version

        print(f"{parser.prog} {version()}")
        raise SystemExit(0)


class _Skipped:
    """A command's parser not built: every call on it does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **kw: self


class _OnlyCommand:
    """The subparsers, with only ``only``'s parser built (the others' arguments cost a one-shot
    command's start for nothing); ``found``: whether it was one of them."""

    def __init__(self, sub: Any, only: str) -> None:
        self.sub, self.only, self.found = sub, only, False

    def add_parser(self, name: str, **kw: Any) -> Any:
        if name != self.only:
            return _Skipped()
        self.found = True
        return self.sub.add_parser(name, **kw)
