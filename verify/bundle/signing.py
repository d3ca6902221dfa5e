"""Signing bundles with the contributor's Ed25519 key (securesystemslib's ``CryptoSigner``; no crypto here):
``sign_bundle`` writes the attestation (its format and check: ``attestation.py``) into a finished bundle
that verifies.

Keys: ``k3-verify keys new PATH`` writes PATH (the private key, PKCS#8 PEM, mode 0600) and
PATH.pub.json (``{"keys": [entry]}``, the file format ``--trusted-keys`` reads: a maintainer merges the
entries of the contributors they trust into one such file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from verify.bundle.attestation import PAYLOAD_TYPE, key_entry, load_public_keys, sslib, statement
from verify.bundle.schema import ATTESTATION, MANIFEST, RUNNING, BundleError

PUBLIC_SUFFIX = ".pub.json"


# ------------------------------------------------------------------------------------------ keys
def new_key(path: Path, name: str | None = None) -> dict[str, Any]:
    """A fresh Ed25519 key: the private key at ``path`` (0600, never overwritten) and its public entry at
    ``path.pub.json``; returns the entry."""
    _, CryptoSigner, _, _ = sslib()
    path = Path(path)
    pub = path.with_name(path.name + PUBLIC_SUFFIX)
    for p in (path, pub):
        if p.exists():
            raise BundleError(f"{p} exists: a key is never overwritten (choose another path)")
    if not path.parent.is_dir():
        raise BundleError(f"{path.parent}: no such directory")
    signer = CryptoSigner.generate_ed25519()
    entry = key_entry(signer.public_key, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(signer.private_bytes)
    pub.write_text(json.dumps({"keys": [entry]}, indent=1) + "\n")
    return entry


def load_signer(path: Path):
    """The ``CryptoSigner`` of an Ed25519 private key file written by ``new_key``."""
    _, CryptoSigner, _, _ = sslib()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    path = Path(path)
    try:
        key = load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise BundleError(f"{path}: no such key file") from None
    except (ValueError, TypeError) as e:
        raise BundleError(f"{path}: not an unencrypted PEM private key ({' '.join(str(e).split())[:100]})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"{path}: a {type(key).__name__}; bundles are signed with Ed25519 keys (keys new)")
    return CryptoSigner(key)


def show_key(path: Path) -> dict[str, Any]:
    """The public entry of a private key file or the first key of a public key file."""
    path = Path(path)
    if path.name.endswith(PUBLIC_SUFFIX) or path.suffix == ".json":
        return key_entry(load_public_keys(path)[0])
    return key_entry(load_signer(path).public_key)


# ------------------------------------------------------------------------------------------ sign
def sign_bundle(root: Path, signer: Any) -> dict[str, Any]:
    """Write ``attestation.dsse.json`` into a finished bundle directory that verifies; returns the statement.
    An existing attestation is replaced (the new one covers the bundle as it is now); a refusal leaves the
    bundle as it was."""
    from verify.bundle.verify import verify_bundle

    Envelope, _, _, _ = sslib()
    root = Path(root)
    if not (root / MANIFEST).is_file():
        raise BundleError(f"{root}: not a bundle directory (no {MANIFEST})")
    stale = root / ATTESTATION
    old = stale.read_bytes() if stale.exists() else None
    if old is not None:  # the bundle is judged without it; a refusal puts it back
        stale.unlink()
    manifest = json.loads((root / MANIFEST).read_text())
    report = verify_bundle(root)
    problem = (f"does not verify, refusing to sign it ({report.problems[0]})" if not report.ok else
               "still running; sign a finished or interrupted bundle" if manifest.get("state") == RUNNING else None)
    if problem:
        if old is not None:
            stale.write_bytes(old)
        raise BundleError(f"{root}: {problem}", 1 if not report.ok else 2)
    st = statement(root, manifest, signer.public_key)
    env = Envelope(payload=json.dumps(st, sort_keys=True, separators=(",", ":")).encode(),
                   payload_type=PAYLOAD_TYPE, signatures={})
    env.sign(signer)
    tmp = root / f".{ATTESTATION}.tmp"
    tmp.write_text(json.dumps(env.to_dict(), indent=1) + "\n")
    os.replace(tmp, root / ATTESTATION)
    return st


