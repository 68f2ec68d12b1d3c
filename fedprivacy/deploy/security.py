"""Credentials for a local deployment: a TLS CA and a localhost server certificate for the SuperLink,
and one SuperNode authentication key pair per SuperNode.

Flower 1.41's formats (checked against ``flower-superlink``/``flower-supernode --help`` and the
loaders in ``flwr/supernode/cli/flower_supernode.py`` and ``flwr/cli/supernode/register.py``):

- SuperLink TLS: ``--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key`` (PEM);
  one port serves the Fleet, Control and Runtime HTTP APIs, so one certificate covers all three.
  SuperNodes verify it with ``--root-certificates ca.crt``; the ``flwr`` CLI with
  ``root-certificates = "<abs path>/ca.crt"`` in its connection.
- SuperNode authentication: an EC key on a NIST curve (P-384 here). The SuperNode reads the private
  key in OpenSSH format (``--auth-supernode-private-key``); ``flwr supernode register`` reads the
  public key in OpenSSH format. The SuperLink needs ``--enable-supernode-auth`` and refuses it
  without TLS.

Only the ``cryptography`` package is used (a Flower dependency), so no ``openssl`` binary is needed.
The keys are for a local prototype: unencrypted on disk, mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKeys:
    private_key: Path
    """OpenSSH private key (``flower-supernode --auth-supernode-private-key``)."""
    public_key: Path
    """OpenSSH public key (``flwr supernode register``)."""


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedprivacy local deployment"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def generate_tls(folder: Path, hosts: tuple[str, ...] = LOCAL_HOSTS, days: int = 30) -> TlsFiles:
    """A self-signed CA and a server certificate for ``hosts`` (DNS names and IP addresses as SANs)."""
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name("fedprivacy local CA")).issuer_name(_name("fedprivacy local CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA384()))
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    no_pass = serialization.NoEncryption()
    return TlsFiles(
        ca_cert=_write(folder / "ca.crt", ca_cert.public_bytes(pem)),
        server_cert=_write(folder / "server.pem", cert.public_bytes(pem)),
        server_key=_write(folder / "server.key",
                          key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pass), private=True),
    )


def generate_node_keys(folder: Path, name: str) -> NodeKeys:
    """An EC P-384 key pair in the OpenSSH formats Flower's SuperNode and CLI read."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return NodeKeys(private_key=_write(folder / name, private, private=True),
                    public_key=_write(folder / f"{name}.pub", public + b"\n"))
