"""`make tiktoken-files`: OpenAI's encoding files for `--token-counter tiktoken:<encoding>`, offline.

tiktoken downloads an encoding's file from OpenAI at first use, which cannot work offline. The `litellm` package
(BerriAI) ships copies of tiktoken's download cache for cl100k_base, p50k_base and o200k_base, named as tiktoken
names them (the SHA-1 of the URL). This script fetches litellm's wheel with pip (`pip download --no-deps`: it is
neither installed nor imported), takes those files out of it, checks each against the SHA-256 that tiktoken's own
encoding definitions publish, and writes the matching ones to `$TOOLQUAKE_CACHE/tiktoken/<encoding>.tiktoken`,
where `tiktoken:<encoding>` looks first. A file whose hash differs is refused, whoever shipped it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

LITELLM = "litellm==1.110.2"
INSIDE = "litellm/litellm_core_utils/tokenizers/"


def _cache() -> Path:
    return Path(os.environ.get("TOOLQUAKE_CACHE") or Path.home() / ".cache" / "toolquake")


def _wheel(wheels: Path) -> Path:
    found = sorted(wheels.glob("litellm-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", LITELLM, "-d", str(wheels)],
                       check=True)
        found = sorted(wheels.glob("litellm-*.whl"))
    if not found:
        raise SystemExit(f"tiktoken-files: pip left no litellm wheel in {wheels}")
    return found[-1]


def main() -> int:
    from toolquake.perturbers.helpers.tiktoken_files import ENCODINGS, wanted_file

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="a litellm wheel already on disk (default: pip download into "
                    "$TOOLQUAKE_CACHE/wheels/litellm once)")
    ap.add_argument("--dest", type=Path, help="where to write the .tiktoken files (default $TOOLQUAKE_CACHE/tiktoken)")
    args = ap.parse_args()
    dest = args.dest or _cache() / "tiktoken"
    wheel = args.wheel or _wheel(_cache() / "wheels" / "litellm")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for encoding in ENCODINGS:
            url, digest = wanted_file(encoding)
            member = INSIDE + hashlib.sha1(url.encode()).hexdigest()
            target = dest / url.rsplit("/", 1)[-1]  # OpenAI's file name: encodings that share a file share it
            if member not in names or target in written:
                continue
            data = zf.read(member)
            if hashlib.sha256(data).hexdigest() != digest:
                print(f"tiktoken-files: {encoding}: {wheel.name} holds a file whose sha256 is not tiktoken's; "
                      "skipped", file=sys.stderr)
                continue
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
            written.append(target)
    if not written:
        print(f"tiktoken-files: no encoding file found in {wheel}", file=sys.stderr)
        return 1
    print(f"tiktoken-files: {', '.join(p.name for p in written)} in {dest} (sha256 checked against tiktoken's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
