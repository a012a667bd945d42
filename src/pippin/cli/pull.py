"""`pippin pull MODEL`: a model from Hugging Face into pippin's library, with a progress
bar per file (`pippin.store.hub_pull`, which Ollama's /api/pull shares)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pippin.store.hub_files import PullError
from pippin.store.hub_pull import PullEvent, pull
from pippin.store.library import ModelLibrary, default_root

PULL_DESCRIPTION = """\
Download a model from Hugging Face into pippin's library (--models-dir), where
'pippin serve' and Ollama's clients find it by name. MODEL is Ollama's name for a
Hugging Face repo: hf.co/ORG/REPO:QUANT picks one GGUF file by its quantisation
(Q4_K_M when no tag is given), ORG/REPO an MLX or safetensors model folder.
An interrupted pull resumes where it stopped; pulling a model again updates it."""


def add_pull_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``pull`` subcommand (``subparsers``: `ArgumentParser.add_subparsers`'s)."""
    p = subparsers.add_parser(
        "pull",
        help="download a model from Hugging Face into pippin's library",
        description=PULL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="hf.co/ORG/REPO[:QUANT] or ORG/REPO")
    p.add_argument(
        "--models-dir",
        metavar="DIR",
        default=None,
        help="the library folder, as 'pippin serve --models-dir' takes it (default: models "
        "in pippin's cache folder, $PIPPIN_CACHE_DIR or ~/.cache/pippin)",
    )
    p.add_argument(
        "--revision",
        metavar="REV",
        default=None,
        help="a branch, tag or commit of the repo (default: its main branch)",
    )
    return p


class _Bars:
    """One tqdm bar per file, as Ollama's CLI shows them; status lines between them. Where
    the output is no terminal, one line per file once it is complete."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.bar: Any = None
        self.digest: str | None = None
        self.label = ""

    def show(self, e: PullEvent) -> None:
        if e.digest is None:
            self.close()
            print(e.status, file=self.out, flush=True)
            return
        if e.digest != self.digest:
            from tqdm import tqdm

            self.close()
            self.label = f"pulling {e.file or e.digest[7:19]}"
            self.bar = tqdm(
                total=e.total,
                initial=e.completed or 0,
                desc=self.label,
                unit="B",
                unit_scale=True,
                file=self.out,
                disable=not self.tty,
                dynamic_ncols=True,
            )
            self.digest = e.digest
        self.bar.update((e.completed or 0) - self.bar.n)
        if not self.tty and e.completed == e.total:
            print(f"{self.label}: {e.total} bytes", file=self.out, flush=True)
            self.digest = None  # printed once

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.digest = None, None


def pull_command(args: argparse.Namespace) -> int:
    """Run ``pippin pull``: 0 once the model is in the library, 1 with one line on
    stderr if it could not be pulled, 130 when interrupted (it resumes next time)."""
    library = ModelLibrary(args.models_dir or default_root())
    bars = _Bars(sys.stderr)
    try:
        stored = pull(args.model, library, bars.show, revision=args.revision)
    except PullError as e:
        bars.close()
        print(f"pippin pull: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        bars.close()
        print("pippin pull: interrupted; pull again to resume", file=sys.stderr)
        return 130
    bars.close()
    print(stored.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pippin.cli.pull MODEL ...``: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="pippin")
    add_pull_parser(parser.add_subparsers(dest="command", required=True))
    return pull_command(parser.parse_args(["pull", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
