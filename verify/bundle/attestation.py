"""The attestation of a signed bundle: its format and its check. ``attestation.dsse.json`` at the bundle's
root holds a DSSE envelope (securesystemslib's ``Envelope``; no crypto here) whose payload is an in-toto
Statement v1: ``subject`` lists every other file of the bundle with its SHA-256 (SHA256SUMS and
manifest.json included, so the whole bundle is bound); ``predicate`` states the tier, state, verdict and
its reasons, the source identity (``env.git`` and ``env.source_tree_sha256``), the image, the GPUs and the
signer's public key. The attestation is the one file SHA256SUMS does not list (it signs SHA256SUMS).

``bundle verify`` (``attestation_problems``): with no attestation, the note "unsigned" (and a problem when
``--trusted-keys`` asks for a signature); otherwise the envelope must be one signature by the key the
predicate names, verifying over the payload, every subject must be a file of this bundle with that
digest and every file a subject (a changed bundle or an attestation copied from another bundle fails),
and with ``--trusted-keys`` (``load_public_keys``) the key must be one of them. Signing: ``signing.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verify.bundle.schema import ATTESTATION, MANIFEST, SUMS, BundleError, sha256_file, walk_bundle

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://k3-verify.dev/attestation/bundle/v1"


def sslib():
    """securesystemslib's (Envelope, CryptoSigner, SSlibKey, compute_default_keyid), or a clear error."""
    try:
        from securesystemslib.dsse import Envelope
        from securesystemslib.signer import CryptoSigner, SSlibKey
        from securesystemslib.signer._utils import compute_default_keyid
    except ImportError as e:
        raise BundleError(f"signing needs securesystemslib with cryptography (pip install "
                          f"'securesystemslib[crypto]'): {e}") from None
    return Envelope, CryptoSigner, SSlibKey, compute_default_keyid


def key_entry(key: Any, name: str | None = None) -> dict[str, Any]:
    """A public key as ``--trusted-keys`` lists it."""
    entry = {"keyid": key.keyid, **key.to_dict()}
    if name:
        entry["name"] = name
    return entry


def load_public_keys(path: Path) -> list[Any]:
    """The keys of a ``--trusted-keys`` file (``{"keys": [entry, ...]}``); each entry's keyid must be the
    one its key material gives, so a key cannot be listed under another's id."""
    _, _, SSlibKey, compute_default_keyid = sslib()
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: no such trusted-keys file") from None
    except ValueError as e:
        raise BundleError(f"{path}: not JSON ({' '.join(str(e).split())[:100]})") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BundleError(f'{path}: a trusted-keys file is {{"keys": [entry, ...]}} (keys new writes one)')
    keys = []
    for i, e in enumerate(entries):
        try:
            body = {k: e[k] for k in ("keytype", "scheme", "keyval")}
            key = SSlibKey.from_dict(e["keyid"], dict(body))
        except (KeyError, TypeError, ValueError) as err:
            raise BundleError(f"{path}: key {i} is not a key entry ({type(err).__name__}: {err})") from None
        if key.keytype != "ed25519":
            raise BundleError(f"{path}: key {i} is {key.keytype}; bundles are signed with Ed25519 keys")
        if compute_default_keyid(key.keytype, key.scheme, key.keyval) != key.keyid:
            raise BundleError(f"{path}: key {i}'s keyid {key.keyid[:16]} is not the one its key material gives")
        keys.append(key)
    return keys


def _subjects(root: Path) -> list[dict[str, Any]]:
    files, odd = walk_bundle(root)
    if odd:
        raise BundleError(f"{root}: {odd[0]} is not a regular file; a bundle holds regular files only", 1)
    return [{"name": rel, "digest": {"sha256": sha256_file(root / rel)[0]}} for rel in files if rel != ATTESTATION]


def statement(root: Path, manifest: Mapping[str, Any], signer_key: Any) -> dict[str, Any]:
    env = manifest.get("env") or {}
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subjects(root),
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "tool": manifest.get("tool"),
            "tier": manifest.get("tier"),
            "state": manifest.get("state"),
            "verdict": manifest.get("verdict"),
            "verdict_reasons": manifest.get("verdict_reasons"),
            "started_at": manifest.get("started_at"),
            "ended_at": manifest.get("ended_at"),
            "source": {"tree_sha256": env.get("source_tree_sha256"), "git": env.get("git")},
            "image": env.get("image"),
            "gpus": env.get("gpus"),
            "signer": key_entry(signer_key),
        },
    }


# ------------------------------------------------------------------------------------------ verify
def attestation_problems(root: Path, files: Sequence[str], trusted: Sequence[Any] | None
                         ) -> tuple[list[str], list[str], dict[str, Any] | None]:
    """(problems, notes, signature summary) for the bundle at ``root`` whose files are ``files``."""
    if ATTESTATION not in files:
        if trusted is not None:
            return [f"unsigned: --trusted-keys asks for a signature by one of {len(trusted)} trusted key(s)"], [], None
        return [], ["unsigned"], None
    Envelope, _, SSlibKey, compute_default_keyid = sslib()
    where = ATTESTATION
    try:
        env = Envelope.from_dict(json.loads((root / ATTESTATION).read_text()))
        st = json.loads(env.payload)
    except Exception as e:  # any malformed envelope or payload is the same finding
        return [f"{where}: not a DSSE envelope of a JSON statement ({type(e).__name__}: {str(e)[:100]})"], [], None
    if env.payload_type != PAYLOAD_TYPE or not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE \
            or st.get("predicateType") != PREDICATE_TYPE:
        return [f"{where}: not a k3-verify bundle statement (payloadType {env.payload_type!r})"], [], None
    entry = (st.get("predicate") or {}).get("signer") or {}
    try:
        key = SSlibKey.from_dict(entry["keyid"], {k: entry[k] for k in ("keytype", "scheme", "keyval")})
    except (KeyError, TypeError, ValueError):
        return [f"{where}: the statement names no signer key"], [], None
    info = {"keyid": key.keyid, "trusted": None}
    problems = []
    if compute_default_keyid(key.keytype, key.scheme, key.keyval) != key.keyid:
        problems.append(f"{where}: the signer's keyid is not the one its key material gives")
    if len(env.signatures) != 1 or key.keyid not in env.signatures:
        problems.append(f"{where}: {len(env.signatures)} signature(s), none by the key the statement names "
                        f"({key.keyid[:16]})")
    else:
        try:
            env.verify([key], 1)
        except Exception:
            problems.append(f"{where}: the signature does not verify over the statement (edited after signing)")
    if trusted is not None:
        match = [k for k in trusted if k.keyid == key.keyid and k.keyval == key.keyval]
        info["trusted"] = bool(match)
        if not match:
            problems.append(f"{where}: signed by key {key.keyid[:16]}, which is not in --trusted-keys")
    subjects = {s.get("name"): (s.get("digest") or {}).get("sha256") for s in st.get("subject") or []
                if isinstance(s, dict)}
    present = [f for f in files if f != ATTESTATION]
    changed = [f for f in present if f in subjects and subjects[f] != sha256_file(root / f)[0]]
    extra, gone = sorted(set(present) - set(subjects)), sorted(set(subjects) - set(present))
    if MANIFEST in changed or SUMS in changed:
        problems.append(f"{where}: signed another bundle, or this one before it changed ({MANIFEST} or {SUMS} "
                        "differs from the signed digest)")
    for f in changed:
        if f not in (MANIFEST, SUMS):
            problems.append(f"{where}: {f} changed after signing")
    problems += [f"{where}: {f} was added after signing" for f in extra]
    problems += [f"{where}: {f} was signed but is not in the bundle" for f in gone]
    if not problems:
        trust = "a trusted key" if info["trusted"] else "a key not checked against --trusted-keys"
        return [], [f"signed by {key.keyid[:16]} ({trust}), {len(subjects)} files"], info
    return problems, [], info
