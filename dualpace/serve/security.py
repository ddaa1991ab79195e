"""Who may reach a daemon: loopback by default, TLS beyond it, an optional shared token.

    --listen HOST:PORT          a loopback host needs nothing more;
                                any other host (0.0.0.0, a NIC address, a name) needs TLS
    --tls-cert PEM --tls-key PEM   server certificate chain and private key
    --tls-client-ca PEM         also require client certificates signed by this CA (mTLS)
    --auth-token-file PATH      require `authorization: Bearer TOKEN` on every RPC but health

Files are read once at start; a missing or unreadable file is an InvalidArgument
naming its flag, so the daemon refuses to start with one line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from dualpace.errors import InvalidArgument
from dualpace.serve.address import UNIX_PREFIX, ListenAddress, is_loopback, parse_listen
from dualpace.serve.auth import read_token_file


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes of the server's certificate chain and key, and of the client CA for mTLS."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


    def peer_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials for this daemon's calls to the other daemons: their server
        certificates are checked against --tls-client-ca when given (one CA for the whole
        deployment, as mutual TLS has it), else the system's roots; this daemon's own
        certificate goes along, for peers that require client certificates."""
        return grpc.ssl_channel_credentials(root_certificates=self.client_ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def data_server_context(self) -> ssl.SSLContext:
        """The KV data socket's TLS (dualpace.engine.transfer.kv_tcp_import), as server_credentials: this
        certificate, and client certificates required where --tls-client-ca is given."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load_chain(context)
        if self.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
        return context

    def data_client_context(self) -> ssl.SSLContext:
        """A sender's TLS to a peer's KV data socket, as peer_credentials: the peer's certificate checked
        against --tls-client-ca (else the system's roots) and its host name; this certificate sent."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
        else:
            context.load_default_certs()
        self._load_chain(context)
        return context

    def _load_chain(self, context: ssl.SSLContext) -> None:
        """ssl loads a certificate chain only from files: written to a private directory and removed."""
        with tempfile.TemporaryDirectory(prefix="dualpace-tls-") as folder:
            cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, data in ((cert, self.cert_chain), (key, self.private_key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                    file.write(data)
            context.load_cert_chain(cert, key)


def peer_credentials_for(address: str, tls: TlsConfig | None) -> grpc.ChannelCredentials | None:
    """The credentials of this daemon's calls to the daemon at `address`: TLS when this daemon
    serves TLS itself and the address is TCP (engines with certificates serve TLS on every
    address, loopback too), None (plaintext) otherwise (no TLS here, or a unix: socket, which
    only this machine reaches)."""
    if tls is None or address.startswith(UNIX_PREFIX):
        return None
    return tls.peer_credentials()


def peer_channel(address: str, tls: TlsConfig | None, options: list[tuple[str, int]],
                 interceptors=None) -> grpc.aio.Channel:
    """A channel from this daemon to another daemon at `address` (KV migration, the router's
    engines with --engine-tls on): over TLS or plaintext as peer_credentials_for says."""
    credentials = peer_credentials_for(address, tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


@dataclass(frozen=True)
class ServerSecurity:
    tls: TlsConfig | None = None
    auth_token: str | None = None


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security", "loopback needs none of these; a non-loopback --listen needs TLS")
    group.add_argument("--tls-cert", default=None, metavar="PEM", help="server certificate chain (PEM)")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="server private key (PEM)")
    group.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    group.add_argument("--auth-token-file", default=None, metavar="PATH",
                       help="shared token: every RPC but health must send 'authorization: Bearer TOKEN'; "
                            "this daemon's own calls to the other daemons send it too")


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """Reads the TLS files and the token named by the flags (InvalidArgument naming the flag)."""
    return ServerSecurity(
        tls=load_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
        auth_token=read_token_file(args.auth_token_file),
    )


def load_tls(cert_path: str | None, key_path: str | None, client_ca_path: str | None = None) -> TlsConfig | None:
    """The TLS files' contents; None when no TLS flag is given."""
    if cert_path is None and key_path is None:
        if client_ca_path is not None:
            raise InvalidArgument("--tls-client-ca", "needs --tls-cert and --tls-key")
        return None
    if cert_path is None:
        raise InvalidArgument("--tls-cert", "--tls-key needs --tls-cert too")
    if key_path is None:
        raise InvalidArgument("--tls-key", "--tls-cert needs --tls-key too")
    return TlsConfig(
        cert_chain=_read_pem(cert_path, "--tls-cert"),
        private_key=_read_pem(key_path, "--tls-key"),
        client_ca=None if client_ca_path is None else _read_pem(client_ca_path, "--tls-client-ca"),
    )


def check_listen_security(listen: str | ListenAddress, tls: TlsConfig | None, field: str = "--listen",
                          allow_unix: bool = True) -> ListenAddress:
    """The parsed address; InvalidArgument when it is not loopback (nor a Unix socket) and there is no TLS."""
    address = parse_listen(listen, field, allow_unix=allow_unix) if isinstance(listen, str) else listen
    if address.is_unix:
        return address  # this machine only; the socket file's permissions decide who connects
    if tls is None and not is_loopback(address.host):
        raise InvalidArgument(
            field,
            f"{address.target()} is not a loopback address; serving beyond this machine needs TLS: "
            "give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), or listen on 127.0.0.1",
        )
    return address


def _read_pem(path: str, field: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(field, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(field, f"{path} is not a PEM file")
    return data
