"""Signed bundles (verify/bundle/signing.py, verify/bundle/attestation.py): keys, sign, verify with and without --trusted-keys, and the
forgeries a signature must catch -- a bundle changed after signing, an attestation moved to another bundle,
a statement edited, a signature by another key under the trusted keyid, files added or removed."""

from __future__ import annotations

import base64
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import make_golden_bundle as golden
import pytest
from test_bundle import edit_results, reseal, small_writer

from verify.bundle import schema
from verify.bundle.schema import ATTESTATION, BundleError
from verify.bundle.signing import load_signer, new_key, show_key, sign_bundle
from verify.bundle.verify import verify_bundle
from verify.bundle.writer import BundleWriter, write_tarball
from verify.result import CheckResult

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "verify.cli"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    new_key(d / "alice.key", "alice")
    new_key(d / "mallory.key", "mallory")
    return {"alice": d / "alice.key", "alice_pub": d / "alice.key.pub.json", "mallory": d / "mallory.key",
            "mallory_pub": d / "mallory.key.pub.json"}


@pytest.fixture
def signed(tmp_path: Path, keys) -> Path:
    dst = tmp_path / "golden-smoke"
    shutil.copytree(golden.GOLDEN, dst)
    sign_bundle(dst, load_signer(keys["alice"]))
    return dst


def _problems(root, **kw) -> list[str]:
    report = verify_bundle(root, **kw)
    assert not report.ok and report.exit_code == 1, report
    return list(report.problems)


def test_a_key_is_private_never_overwritten_and_shown_as_its_public_entry(keys):
    assert stat.S_IMODE(keys["alice"].stat().st_mode) == 0o600
    entry = json.loads(keys["alice_pub"].read_text())["keys"][0]
    assert entry["keytype"] == "ed25519" and entry["name"] == "alice"
    assert show_key(keys["alice"])["keyid"] == show_key(keys["alice_pub"])["keyid"] == entry["keyid"]
    with pytest.raises(BundleError, match="never overwritten"):
        new_key(keys["alice"])
    with pytest.raises(BundleError, match="not an unencrypted PEM private key"):
        load_signer(keys["alice_pub"])


def test_unsigned_verifies_with_a_note_and_fails_when_a_signature_is_asked_for(tmp_path, keys):
    report = verify_bundle(golden.GOLDEN)
    assert report.ok and "unsigned" in report.notes
    assert "unsigned: --trusted-keys asks for a signature" in _problems(golden.GOLDEN,
                                                                         trusted_keys=keys["alice_pub"])[0]


def test_a_signed_bundle_verifies_by_a_trusted_key_and_fails_by_another(signed, keys):
    report = verify_bundle(signed, trusted_keys=keys["alice_pub"])
    assert report.ok and report.summary["signature"]["trusted"] is True
    assert any(n.startswith("signed by") and "a trusted key" in n for n in report.notes)
    assert verify_bundle(signed).ok  # without trusted keys: integrity only, said so in the note
    assert "which is not in --trusted-keys" in _problems(signed, trusted_keys=keys["mallory_pub"])[0]
    statement = json.loads(base64.b64decode(json.loads((signed / ATTESTATION).read_text())["payload"]))
    names = {s["name"] for s in statement["subject"]}
    assert schema.SUMS in names and schema.MANIFEST in names and ATTESTATION not in names
    assert statement["predicate"]["verdict"] == json.loads((signed / schema.MANIFEST).read_text())["verdict"]


def test_a_consistent_forgery_after_signing_fails(signed, keys):
    """A status flipped with results, sums re-sealed: the bundle alone verifies, its signature does not."""
    edit_results(signed, "reference.determinism", status="failed", reason="forged")
    reseal(signed)
    problems = _problems(signed, trusted_keys=keys["alice_pub"])
    assert any("SHA256SUMS differs from the signed digest" in p for p in problems), problems
    assert any("results.jsonl changed after signing" in p for p in problems), problems


def test_an_attestation_moved_to_another_bundle_fails(signed, tmp_path, keys):
    other = tmp_path / "other"
    w = small_writer(other, planned=("a.one",))
    w.add_result(CheckResult("a.one", "passed"))
    w.finalize()
    shutil.copy(signed / ATTESTATION, other / ATTESTATION)
    problems = _problems(other, trusted_keys=keys["alice_pub"])
    assert "signed another bundle" in problems[0], problems


def test_a_statement_edited_or_resigned_under_the_trusted_keyid_fails(signed, keys):
    env = json.loads((signed / ATTESTATION).read_text())
    st = json.loads(base64.b64decode(env["payload"]))
    st["predicate"]["verdict"] = "pass"
    env["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    (signed / ATTESTATION).write_text(json.dumps(env))
    assert "does not verify over the statement" in _problems(signed)[0]
    # mallory signs the statement but keeps alice's keyid on the signature and in the statement
    from securesystemslib.dsse import Envelope

    mallory = load_signer(keys["mallory"])
    e = Envelope(payload=json.dumps(st).encode(), payload_type=env["payloadType"], signatures={})
    e.sign(mallory)
    d = e.to_dict()
    d["signatures"][0]["keyid"] = st["predicate"]["signer"]["keyid"]
    (signed / ATTESTATION).write_text(json.dumps(d))
    assert "does not verify over the statement" in _problems(signed, trusted_keys=keys["alice_pub"])[0]


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_file_added_or_removed_after_signing_fails(signed, change):
    if change == "added":
        (signed / "logs" / "extra.log").write_text("x\n")
        reseal(signed)
        want = "logs/extra.log was added after signing"
    else:
        victim = next(p for p in sorted((signed / "records").iterdir()))
        victim.unlink()
        reseal(signed)
        want = f"records/{victim.name} was signed but is not in the bundle"
    assert any(want in p for p in _problems(signed)), _problems(signed)


def test_the_tarball_carries_the_signature(signed, keys):
    tar = write_tarball(signed)
    assert verify_bundle(tar, trusted_keys=keys["alice_pub"]).ok


def test_a_bundle_that_does_not_verify_is_not_signed(tmp_path, keys):
    dst = tmp_path / "b"
    shutil.copytree(golden.GOLDEN, dst)
    edit_results(dst, "reference.determinism", status="failed")
    with pytest.raises(BundleError, match="does not verify, refusing to sign"):
        sign_bundle(dst, load_signer(keys["alice"]))
    assert not (dst / ATTESTATION).exists()


def test_resuming_drops_the_signature_of_the_old_part(tmp_path, keys):
    root = tmp_path / "b"
    part = {"gpu": None, "source_tree_sha256": "0" * 64}
    w = small_writer(root, planned=("a.one", "a.two"), part=dict(part, checks=["a.one", "a.two"]))
    w.add_result(CheckResult("a.one", "passed"))
    w.finalize("interrupted")
    sign_bundle(root, load_signer(keys["alice"]))
    w2 = BundleWriter.resume(root, dict(part, checks=["a.two"]))
    assert not (root / ATTESTATION).exists()
    w2.add_result(CheckResult("a.two", "passed"))
    w2.finalize()
    report = verify_bundle(root)
    assert report.ok and "unsigned" in report.notes


def test_cli_keys_sign_and_verify(tmp_path):
    def cli(*args):
        return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO)

    key = tmp_path / "k.key"
    assert cli("keys", "new", str(key)).returncode == 0
    r = cli("keys", "new", str(key))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "never overwritten" in r.stderr
    dst = tmp_path / "golden-smoke"
    shutil.copytree(golden.GOLDEN, dst)
    assert cli("bundle", "sign", str(dst), "--key", str(key)).returncode == 0
    r = cli("bundle", "verify", str(dst), "--trusted-keys", f"{key}.pub.json")
    assert r.returncode == 0 and "a trusted key" in r.stdout, r.stdout + r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"keys": []}')
    r = cli("bundle", "verify", str(dst), "--trusted-keys", str(bad))
    assert r.returncode == 2 and "a trusted-keys file is" in r.stderr


def test_run_sign_signs_the_bundle_and_a_bad_key_writes_nothing(tmp_path):
    tier = tmp_path / "t.yaml"
    tier.write_text("name: t\ndescription: d\ntarget_s: 600\nchecks:\n  - id: reference.determinism\n    budget_s: 120\n")
    key = tmp_path / "k.key"
    new_key(key)
    out = tmp_path / "b"
    r = subprocess.run([*CLI, "run", "--tier", str(tier), "--device", "cpu", "-o", str(out), "--sign", str(tmp_path / "no.key")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "no such key file" in r.stderr and not out.exists()
    r = subprocess.run([*CLI, "run", "--tier", str(tier), "--device", "cpu", "-o", str(out), "--sign", str(key)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert verify_bundle(out.with_name("b.tar.gz"), trusted_keys=f"{key}.pub.json").ok


def test_a_refused_resign_leaves_the_old_signature(signed, keys):
    before = (signed / ATTESTATION).read_bytes()
    edit_results(signed, "reference.determinism", status="failed")  # the bundle no longer verifies
    with pytest.raises(BundleError, match="does not verify, refusing to sign"):
        sign_bundle(signed, load_signer(keys["alice"]))
    assert (signed / ATTESTATION).read_bytes() == before
