"""Signed bundles: an ed25519 signature over manifest.json's bytes, checked before anything else is read.

A bundle is code (loading cpu_stage.so runs it), and the manifest holds the sha256 of every file, so one
signature over the manifest's exact bytes authenticates the whole bundle: an attacker who replaces a
library must rewrite the manifest, which breaks the signature. The signature sits beside the manifest in
`manifest.sig` (JSON: the algorithm, the signing key's fingerprint and the signature), so the manifest's
format does not change and an unsigned bundle stays readable.

Keys: `helmc keygen KEYFILE` writes KEYFILE (PKCS#8 PEM, mode 0600) and KEYFILE.pub (one line:
`helmc-ed25519 <base64 of the 32-byte public key>`). The `cryptography` package does the ed25519 work
(`pip install 'helmc[sign]'`); it is imported only when a key or a signature is in play.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass

from helmc.errors import HelmcError

SIGNATURE_NAME = "manifest.sig"
SIGNATURE_FORMAT_VERSION = 1
PUBLIC_KEY_PREFIX = "helmc-ed25519"
TRUSTED_KEYS_ENV = "HELMC_TRUSTED_KEYS"     # a directory of .pub files, trusted in addition to --trust
_MAX_SIGNATURE_BYTES = 4096                 # a real manifest.sig is ~200 bytes: refuse to parse more


@dataclass(frozen=True)
class PublicKey:
    raw: bytes            # the 32-byte ed25519 public key
    source: str           # where it was read from (for messages)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.raw)


@dataclass(frozen=True)
class SignatureCheck:
    """What verify_manifest_signature found: signed or not, and by which trusted key."""
    signed: bool
    key_fingerprint: str = ""
    key_source: str = ""


def fingerprint(raw_public_key: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw_public_key).hexdigest()[:32]


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise HelmcError("bundle signatures need the cryptography package (pip install 'helmc[sign]'), "
                         "not installed") from None
    return ed25519, serialization, InvalidSignature


# ---- keys -----------------------------------------------------------------------------------------
def generate_keypair(key_path: str) -> PublicKey:
    """Write a new private key to key_path (0600, never overwriting) and its public key to key_path.pub."""
    if not key_path or key_path.endswith(("/", os.sep)):
        raise HelmcError(f"keygen: expected a file name for the private key, found {key_path!r}")
    ed25519, serialization, _ = _crypto()
    pub_path = key_path + ".pub"
    for p in (key_path, pub_path):
        if os.path.lexists(p):
            raise HelmcError(f"keygen: expected a new file name, found an existing {p} (refusing to overwrite a key)")
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    d = os.path.dirname(os.path.abspath(key_path))
    if not os.path.isdir(d):
        raise HelmcError(f"keygen: expected an existing directory for {key_path}, found nothing at {d}")
    written = []
    try:
        # O_EXCL + 0600 from the start: the private key is never readable by others, not even for a moment.
        for path, mode, data in ((key_path, 0o600, pem),
                                 (pub_path, 0o644, f"{PUBLIC_KEY_PREFIX} {base64.b64encode(raw).decode()}\n".encode())):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
            written.append(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except OSError as e:
        for path in written:          # no half pair left behind (a private key without its .pub, or an empty one)
            try:
                os.unlink(path)
            except OSError:
                pass
        raise HelmcError(f"keygen: expected a writable new file, could not write {e.filename or key_path} "
                         f"({e.strerror or e})") from None
    return PublicKey(raw, pub_path)


def _key_bytes(path: str, what: str, limit: int) -> bytes:
    """The bytes of a key file: a regular file (a FIFO or device refused before it is opened), at most limit."""
    from helmc.jsonio import read_regular_file
    if not os.path.lexists(path):
        raise HelmcError(f"{what}, could not read {path} (no such file)")
    return read_regular_file(path, what, limit=limit)


def _warn_if_readable_by_others(key_path: str) -> None:
    """A private key others can read is no longer the owner's alone: say so (once, on stderr), still use it."""
    import stat
    import sys
    try:
        mode = stat.S_IMODE(os.stat(key_path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        print(f"helmc: warning: private key {key_path} is readable by {'others' if mode & 0o007 else 'its group'} "
              f"(mode {mode:04o}); anyone who can read it can sign bundles as you: chmod 600 {key_path}",
              file=sys.stderr)


def load_private_key(key_path: str):
    ed25519, serialization, _ = _crypto()
    data = _key_bytes(key_path, "--sign: expected a private key file from `helmc keygen`", 1 << 16)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise HelmcError(f"--sign: expected an unencrypted ed25519 private key (PEM, from `helmc keygen`), "
                         f"found something else in {key_path}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise HelmcError(f"--sign: expected an ed25519 private key, found a {type(key).__name__} in {key_path}")
    _warn_if_readable_by_others(key_path)
    return key


def load_public_key(path: str) -> PublicKey:
    data = _key_bytes(path, "trusted key: expected a public key file (KEYFILE.pub from `helmc keygen`)", 1 << 16)
    bad = f"trusted key: expected one line '{PUBLIC_KEY_PREFIX} <base64 of 32 bytes>' in {path}"
    if b"PRIVATE KEY" in data or b"PRIVATE" in data.upper():
        # Never echo any of it: the message may end up in a log or a terminal others see.
        raise HelmcError(f"{bad}, found a PRIVATE key (its content not shown); give the public half, KEYFILE.pub, "
                         f"and keep the private key on the signing machine only")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise HelmcError(f"{bad}, found {len(data)} bytes of binary data") from None
    parts = text.split()
    try:
        raw = base64.b64decode(parts[1], validate=True) if len(parts) >= 2 and parts[0] == PUBLIC_KEY_PREFIX else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        # Only the first word is shown (a key type such as 'ssh-rsa'): the rest could be secret material.
        first = parts[0][:20] if parts else ""
        raise HelmcError(f"{bad}, found {len(data)} bytes starting with {first!r}")
    return PublicKey(raw, path)


def trusted_keys(paths=(), env: dict | None = None) -> tuple[PublicKey, ...]:
    """The keys given as --trust files plus every .pub file in the directory HELMC_TRUSTED_KEYS names."""
    keys = [load_public_key(p) for p in paths]
    env = os.environ if env is None else env
    d = env.get(TRUSTED_KEYS_ENV, "")
    if d:
        if not os.path.isdir(d):
            raise HelmcError(f"{TRUSTED_KEYS_ENV}: expected a directory of .pub files, found nothing at {d}")
        keys += [load_public_key(os.path.join(d, n)) for n in sorted(os.listdir(d)) if n.endswith(".pub")]
    return tuple(keys)


# ---- signing and verifying ------------------------------------------------------------------------
def sign_manifest(manifest_path: str, private_key) -> str:
    """Write manifest.sig beside manifest_path for its bytes as they are; returns the key's fingerprint."""
    from helmc.jsonio import atomic_write_text
    bundle_dir = os.path.dirname(manifest_path)
    _, serialization, _ = _crypto()
    with open(manifest_path, "rb") as f:
        manifest = f.read()
    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = {"format_version": SIGNATURE_FORMAT_VERSION, "algorithm": "ed25519", "key_fingerprint": fingerprint(raw),
           "signature": base64.b64encode(private_key.sign(manifest)).decode()}
    atomic_write_text(os.path.join(bundle_dir, SIGNATURE_NAME), json.dumps(sig, indent=2, sort_keys=True) + "\n")
    return fingerprint(raw)


def _read_signature(path: str) -> tuple[str, bytes]:
    """(key fingerprint, signature bytes) of a manifest.sig, every defect a HelmcError."""
    with open(path, "rb") as f:
        data = f.read(_MAX_SIGNATURE_BYTES + 1)
    bad = f"bundle: {SIGNATURE_NAME} expected a JSON object with format_version {SIGNATURE_FORMAT_VERSION}, " \
          "algorithm 'ed25519', key_fingerprint and signature"
    if len(data) > _MAX_SIGNATURE_BYTES:
        raise HelmcError(f"{bad}, found a file of more than {_MAX_SIGNATURE_BYTES} bytes")
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        raise HelmcError(f"{bad}, found invalid JSON") from None
    if not isinstance(d, dict) or d.get("format_version") != SIGNATURE_FORMAT_VERSION \
            or d.get("algorithm") != "ed25519" or not isinstance(d.get("key_fingerprint"), str) \
            or not isinstance(d.get("signature"), str):
        raise HelmcError(f"{bad}, found {str(d)[:80]}")
    try:
        sig = base64.b64decode(d["signature"], validate=True)
    except (binascii.Error, ValueError):
        raise HelmcError(f"{bad}, found a signature that is not base64") from None
    return d["key_fingerprint"], sig


def verify_manifest_signature(bundle_dir: str, manifest_bytes: bytes, trusted: tuple[PublicKey, ...] = (),
                              require_signed: bool = False) -> SignatureCheck:
    """Check manifest.sig against `manifest_bytes` (the manifest as read, which the caller then parses: the
    bytes checked are the bytes used). With trusted keys, a signature must be by one of them and valid; with
    require_signed, an unsigned bundle is refused. Reads no other file of the bundle."""
    sig_path = os.path.join(bundle_dir, SIGNATURE_NAME)
    if require_signed and not trusted:
        raise HelmcError(f"--require-signed: expected at least one trusted key (--trust KEY.pub or "
                         f"{TRUSTED_KEYS_ENV}=DIR), found none")
    if os.path.islink(sig_path) or (os.path.lexists(sig_path) and not os.path.isfile(sig_path)):
        raise HelmcError(f"bundle: {SIGNATURE_NAME} expected a regular file, found a link or a directory")
    if not os.path.isfile(sig_path):
        if require_signed:
            raise HelmcError(f"bundle: expected a signed bundle ({SIGNATURE_NAME}, --require-signed), found none "
                             f"in {bundle_dir}")
        return SignatureCheck(signed=False)
    if not trusted:                    # nothing to check it against: it says nothing about who made the bundle
        return SignatureCheck(signed=True)
    key_fp, sig = _read_signature(sig_path)
    by_fp = {k.fingerprint: k for k in trusted}
    if key_fp not in by_fp:
        raise HelmcError(f"bundle: signed by key {key_fp!r}, expected one of the trusted keys "
                         f"{sorted(by_fp)}; refusing it")
    key = by_fp[key_fp]
    ed25519, _, InvalidSignature = _crypto()
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(key.raw).verify(sig, manifest_bytes)
    except InvalidSignature:
        raise HelmcError(f"bundle: manifest.json's signature by {key_fp} (trusted, {key.source}) is invalid: "
                         "the manifest was modified after signing; refusing the bundle") from None
    return SignatureCheck(signed=True, key_fingerprint=key_fp, key_source=key.source)
