"""Write the example vLLM bundle, bundles/example-vllm/vllm-cpu-tiny-llama/ (+ .tar.gz).

    python tests/make_vllm_example_bundle.py            # rewrite the committed example
    python tests/make_vllm_example_bundle.py /tmp/out   # write it elsewhere (OUT/vllm-cpu-tiny-llama)

What it runs (needs `scripts/bootstrap --dev --eval --vllm`; about 1-3 minutes on 2 cores):
1. makes the tiny random-weight Llama (verify/engines/tiny_model.py, seed 0) in a temporary directory;
2. ``k3-verify run --tier verify/tiers/vllm-cpu.yaml --engine vllm --baseline-engine vllm --model-dir DIR``:
   the same checks as tests/integration/test_vllm_server.py (every feature check and a 5-item GSM8K
   through the ``openai`` engine), with vLLM launched by k3-verify itself, so the bundle also keeps the
   server's log and launch config (``logs/vllm-tiny.log``, ``logs/vllm-tiny.json``);
3. ``k3-verify bundle verify`` on the directory and the tarball.

Not byte-reproducible (times, the server log); tests/test_committed_bundles.py verifies the committed copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NAME = "vllm-cpu-tiny-llama"
DEFAULT_OUT = REPO / "bundles" / "example-vllm"
TIER = "verify/tiers/vllm-cpu.yaml"  # relative: the tier's eval thresholds path is relative to the repo root


def main(argv: list[str]) -> int:
    from verify.engines.tiny_model import make_tiny_llama

    out_dir = Path(argv[0]).resolve() if argv else DEFAULT_OUT
    bundle = out_dir / NAME
    tarball = out_dir / f"{NAME}.tar.gz"
    shutil.rmtree(bundle, ignore_errors=True)
    tarball.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "verify.cli"]
    with tempfile.TemporaryDirectory(prefix="k3verify-tiny-") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny")
        run = subprocess.run([*cli, "run", "--tier", TIER, "--engine", "vllm", "--baseline-engine", "vllm",
                              "--model-dir", str(model), "-o", str(bundle), "--require-complete"], cwd=REPO)
    if run.returncode != 0:
        print(f"k3-verify run exited {run.returncode}; bundle left at {bundle}", file=sys.stderr)
        return run.returncode
    for target in (bundle, tarball):
        v = subprocess.run([*cli, "bundle", "verify", str(target)], cwd=REPO)
        if v.returncode != 0:
            return v.returncode
    print(f"wrote {bundle} and {tarball}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
