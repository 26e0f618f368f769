"""A local certificate authority for development and CI: broker, client and Redis certificates, with openssl.

A secure local cluster (``rlbus kafka start --secure``) needs what a production one gets from its PKI: a CA
that clients trust, a server certificate per broker whose subject alternative names cover the address
clients dial (127.0.0.1 and ``localhost``), and client certificates for mutual TLS (the brokers' own
inter-broker and controller identities, the administrator's). The JDK reads PKCS#12 keystores, Python's
``ssl`` and redis-server read PEM; every certificate is written both ways.

The openssl commands, for the record (``-nodes``-style unencrypted keys, mode 0600)::

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -keyout ca.key -out ca.pem -days D -subj /CN=...
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -keyout NAME.key -out NAME.csr -subj /CN=NAME
    openssl x509 -req -in NAME.csr -CA ca.pem -CAkey ca.key -extfile ext.cnf -days D -out NAME.pem
    openssl pkcs12 -export -in NAME.pem -inkey NAME.key -certfile ca.pem -out NAME.p12 -passout file:...

An expired certificate (for tests that must see one refused) is signed with ``openssl ca -startdate
-enddate`` in the past. Nothing here is a production PKI: keys are not
encrypted at rest, and the CA key sits next to what it signed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rlbus.errors import ServiceError

DAYS = 825  # the longest validity browsers and most TLS stacks accept for a leaf certificate
_CURVE = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")


@dataclass(frozen=True)
class Issued:
    """One certificate and its key, as PEM and as a PKCS#12 keystore (password in ``password_file``)."""

    name: str
    cert: Path
    key: Path
    p12: Path
    password_file: Path

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()


class LocalCA:
    """A certificate authority kept in ``root`` (``ca.pem``, ``ca.key``); created on first use."""

    def __init__(self, root: Path, *, common_name: str = "rlbus local CA") -> None:
        self.root = root
        self.common_name = common_name

    @property
    def cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def key(self) -> Path:
        return self.root / "ca.key"

    def ensure(self) -> LocalCA:
        """Create the CA unless ``root`` already holds one."""
        if self.cert.is_file() and self.key.is_file():
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        _openssl(
            "req", "-x509", *_CURVE, "-nodes", "-keyout", str(self.key), "-out", str(self.cert),
            "-days", str(DAYS), "-subj", f"/CN={self.common_name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )
        self.key.chmod(0o600)
        return self

    def issue(
        self,
        name: str,
        *,
        server: bool = False,
        client: bool = True,
        hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
        expired: bool = False,
    ) -> Issued:
        """A certificate with subject ``CN=name`` signed by this CA (reused when already issued).

        ``server`` adds ``hosts`` as subject alternative names (IP or DNS) and the serverAuth usage;
        ``client`` adds clientAuth. ``expired`` makes one whose validity ended yesterday (always reissued).
        """
        self.ensure()
        issued = Issued(
            name=name,
            cert=self.root / f"{name}.pem",
            key=self.root / f"{name}.key",
            p12=self.root / f"{name}.p12",
            password_file=self.root / f"{name}.p12.password",
        )
        if not expired and all(p.is_file() for p in (issued.cert, issued.key, issued.p12, issued.password_file)):
            return issued
        csr = self.root / f"{name}.csr"
        extensions = self.root / f"{name}.ext"
        usages = [u for u, wanted in (("serverAuth", server), ("clientAuth", client)) if wanted]
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
        if usages:
            lines.append("extendedKeyUsage=" + ",".join(usages))
        if server:
            names = [f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts]
            lines.append("subjectAltName=" + ",".join(names))
        extensions.write_text("\n".join(lines) + "\n")
        try:
            _openssl(
                "req", "-new", *_CURVE, "-nodes", "-keyout", str(issued.key), "-out", str(csr), "-subj", f"/CN={name}"
            )
            issued.key.chmod(0o600)
            if expired:
                self._sign_expired(csr, extensions, issued.cert)
            else:
                _openssl(
                    "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                    "-CAcreateserial", "-extfile", str(extensions), "-days", str(DAYS), "-out", str(issued.cert),
                )
            issued.password_file.write_text(secrets.token_urlsafe(18) + "\n")
            issued.password_file.chmod(0o600)
            _openssl(
                "pkcs12", "-export", "-in", str(issued.cert), "-inkey", str(issued.key), "-certfile", str(self.cert),
                "-name", name, "-out", str(issued.p12), "-passout", f"file:{issued.password_file}",
            )
            issued.p12.chmod(0o600)
        finally:
            csr.unlink(missing_ok=True)
            extensions.unlink(missing_ok=True)
        return issued

    def _sign_expired(self, csr: Path, extensions: Path, out: Path) -> None:
        """Sign with a validity that ended yesterday: ``openssl ca`` takes explicit dates, ``x509 -req``
        (before openssl 3.4) does not, and ``ca`` needs its small database."""
        db = self.root / "ca-db"
        db.mkdir(exist_ok=True)
        (db / "index.txt").write_text("")
        (db / "serial").write_text(f"{secrets.randbits(64):016X}\n")
        config = db / "ca.cnf"
        config.write_text(
            "[ca]\ndefault_ca = local\n[local]\n"
            f"database = {db}/index.txt\nnew_certs_dir = {db}\nserial = {db}/serial\n"
            "default_md = sha256\npolicy = any\nunique_subject = no\n[any]\ncommonName = supplied\n"
        )
        now = datetime.now(UTC)
        stamp = "%Y%m%d%H%M%SZ"
        _openssl(
            "ca", "-batch", "-config", str(config), "-in", str(csr), "-cert", str(self.cert), "-keyfile", str(self.key),
            "-startdate", (now - timedelta(days=30)).strftime(stamp),
            "-enddate", (now - timedelta(days=1)).strftime(stamp),
            "-extfile", str(extensions), "-notext", "-out", str(out),
        )


def _openssl(*args: str) -> None:
    program = shutil.which("openssl")
    if program is None:
        raise ServiceError("'openssl' not found on PATH; install it (Debian: apt-get install -y openssl)")
    done = subprocess.run([program, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ServiceError(f"openssl {args[0]} failed: {done.stderr.strip()[-800:]}")
