"""TLS on both of the router's APIs (router/tls.py), over the mock engine without Ray: the gRPC server and the
HTTP server started with a TLSConfig whose CA, server and client certificates the test makes with `cryptography`.
Clients that trust the CA are served (TandemClient, the official `openai` client, `tandem generate --target
--tls-ca`, `tandem up --ask`); plaintext clients and clients that do not trust the CA are refused; with
client_ca_file set (mutual TLS), only clients presenting a certificate that CA signed are served. Bad files fail
at start, naming the file."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.cli import main as tandem_main
from tandem.replica.contract import ReadyReplica
from tandem.router.auth import Authenticator
from tandem.router.client import TandemClient
from tandem.router.grpc_service import TandemServicer, start_grpc_server
from tandem.router.http_service import build_app, start_http_server
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode, MockPrefill, token_for
from tandem.router import router_actor
from tandem.router.replicas import Replica
from tandem.router.serving import Serving
from tandem.router.tls import TLSConfig, TLSFileError

from tests.router.router_harness import MODEL, BackgroundLoop, embedded, model_facts

KEY = "sk-acme-0123456789"


# -- certificates ------------------------------------------------------------------------------------------

def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _issue(subject: str, issuer: Issued | None, *, ca: bool = False, hosts: tuple[str, ...] = (),
           usage: x509.ObjectIdentifier | None = None) -> Issued:
    """A certificate for subject, signed by issuer (None: self-signed), valid from a minute ago for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer = key if issuer is None else issuer.key
    builder = (x509.CertificateBuilder().subject_name(_name(subject))
               .issuer_name(_name(subject) if issuer is None else issuer.cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
                              critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    if hosts:
        names = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return Issued(builder.sign(signer, hashes.SHA256()), key)


def _write(folder: Path, stem: str, issued: Issued) -> tuple[str, str]:
    """Writes stem.pem and stem.key; returns their paths."""
    cert, key = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(issued.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    key.chmod(0o600)
    return str(cert), str(key)


@dataclass(frozen=True)
class PKI:
    """Paths of PEM files: the server's CA and its certificate for 127.0.0.1 and localhost; a client CA and a
    client certificate it signed; a CA nobody trusts with a client certificate of its own."""

    ca: str
    server_cert: str
    server_key: str
    client_ca: str
    client_cert: str
    client_key: str
    rogue_ca: str
    rogue_client_cert: str
    rogue_client_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    folder = tmp_path_factory.mktemp("pki")
    ca, client_ca, rogue = (_issue(n, None, ca=True) for n in ("server CA", "client CA", "rogue CA"))
    server = _issue("router", ca, hosts=("127.0.0.1", "localhost"), usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _issue("acme", client_ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_client = _issue("mallory", rogue, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return PKI(_write(folder, "ca", ca)[0], *_write(folder, "server", server),
               _write(folder, "client-ca", client_ca)[0], *_write(folder, "client", client),
               _write(folder, "rogue-ca", rogue)[0], *_write(folder, "rogue-client", rogue_client))


# -- servers -----------------------------------------------------------------------------------------------

def fake_text(prompt_ids, n_tokens: int) -> str:
    return "".join(f"<{token_for(tuple(prompt_ids), i)}>" for i in range(n_tokens))


class Servers(BackgroundLoop):
    """The serving core over mock replicas, its gRPC and HTTP servers (both with tls) on a background loop."""

    def __init__(self, tls: TLSConfig | None):
        super().__init__()
        self.tokenizer = embedded().tokenizer
        facts = model_facts()

        async def boot():
            settings = DriverSettings()
            driver = RequestDriver([Replica("prefill-0", "prefill", MockPrefill("prefill-0"))],
                                   [Replica("decode-0", "decode", MockDecode("decode-0"))], settings)
            serving = Serving(driver, facts, settings.mode, auth=Authenticator({KEY: "acme"}))
            grpc_server, grpc_port, _ = await start_grpc_server(TandemServicer(serving), "127.0.0.1:0", tls=tls)
            http_server, http_port = await start_http_server(build_app(serving), "127.0.0.1:0", tls=tls)
            return grpc_server, grpc_port, http_server, http_port

        self.grpc, grpc_port, self.http, http_port = self.run(boot())
        self.target = f"127.0.0.1:{grpc_port}"
        self.http_port = http_port

    def close(self) -> None:
        self.run(self.http.stop())
        self.run(self.grpc.stop(0))
        self.stop()


@pytest.fixture(scope="module")
def servers(pki):
    s = Servers(TLSConfig(pki.server_cert, pki.server_key))
    yield s
    s.close()


@pytest.fixture(scope="module")
def mutual(pki):
    s = Servers(TLSConfig(pki.server_cert, pki.server_key, client_ca_file=pki.client_ca))
    yield s
    s.close()


def https_client(ca: str | None, cert: tuple[str, str] | None = None) -> httpx.Client:
    """An httpx client trusting ca (None: the system's CAs), presenting cert (certificate, key) if given."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(*cert)
    return httpx.Client(verify=context, timeout=30)


def openai_client(port: int, http_client: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, http_client=http_client,
                         max_retries=0)


def grpc_refused(client: TandemClient) -> grpc.RpcError:
    with client, pytest.raises(grpc.RpcError) as caught:
        client.generate(prompt="Hello", max_tokens=2)
    return caught.value


# -- one-way TLS -------------------------------------------------------------------------------------------

def test_grpc_client_that_trusts_the_ca_is_served(servers, pki):
    prompt_ids = servers.tokenizer.encode("The capital of France is")
    with TandemClient(servers.target, api_key=KEY, tls_ca=pki.ca, timeout_s=30) as client:
        result = client.generate(prompt="The capital of France is", max_tokens=4, temperature=0)
        assert result.text == fake_text(prompt_ids, 4) and result.finish_reason == "length"
        assert client.health() == "SERVING"
    # the certificate names localhost too; the CA may be given as PEM bytes
    localhost = servers.target.replace("127.0.0.1", "localhost")
    with TandemClient(localhost, api_key=KEY, tls_ca=Path(pki.ca).read_bytes(), timeout_s=30) as client:
        assert client.generate(prompt="Hi", max_tokens=2).text == fake_text(servers.tokenizer.encode("Hi"), 2)


def test_openai_client_over_https_gets_a_completion_and_a_stream(servers, pki):
    messages = [{"role": "user", "content": "Hello there"}]
    expected = fake_text(servers.tokenizer.encode_chat(messages), 4)
    with https_client(pki.ca) as http:
        client = openai_client(servers.http_port, http)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert reply.choices[0].message.content == expected
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert http.get(f"https://127.0.0.1:{servers.http_port}/health").status_code == 200


def test_plaintext_clients_are_refused(servers, pki):
    error = grpc_refused(TandemClient(servers.target, api_key=KEY, timeout_s=10))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{servers.http_port}/health", timeout=10)


def test_clients_that_do_not_trust_the_ca_fail_verification(servers, pki):
    error = grpc_refused(TandemClient(servers.target, api_key=KEY, tls_ca=pki.rogue_ca, timeout_s=10))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    with https_client(None) as http, pytest.raises(openai.APIConnectionError) as caught:
        openai_client(servers.http_port, http).models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(caught.value.__cause__)
    # and the servers keep serving trusting clients
    with TandemClient(servers.target, api_key=KEY, tls_ca=pki.ca, timeout_s=30) as client:
        assert client.generate(prompt="Hi", max_tokens=1).finish_reason == "length"


# -- mutual TLS --------------------------------------------------------------------------------------------

def test_mutual_tls_serves_only_clients_with_a_certificate_the_client_ca_signed(mutual, pki):
    for cert in (None, (pki.rogue_client_cert, pki.rogue_client_key)):
        error = grpc_refused(TandemClient(mutual.target, api_key=KEY, tls_ca=pki.ca, tls_cert=cert, timeout_s=10))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        with https_client(pki.ca, cert) as http, pytest.raises(openai.APIConnectionError):
            openai_client(mutual.http_port, http).models.list()
    mine = (pki.client_cert, pki.client_key)
    with TandemClient(mutual.target, api_key=KEY, tls_ca=pki.ca, tls_cert=mine, timeout_s=30) as client:
        assert client.generate(prompt="Hi", max_tokens=2).text == fake_text(mutual.tokenizer.encode("Hi"), 2)
    with https_client(pki.ca, mine) as http:
        reply = openai_client(mutual.http_port, http).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert reply.choices[0].text == fake_text(mutual.tokenizer.encode("Hi"), 2)


# -- tandem generate --target --tls-ca ----------------------------------------------------------------------

def test_tandem_generate_with_tls_ca(servers, pki, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)
    args = ["generate", "--target", servers.target, "--prompt", "Hi", "--max-tokens", "3", "--json"]
    assert tandem_main(args + ["--tls-ca", pki.ca]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == fake_text(servers.tokenizer.encode("Hi"), 3)
    assert tandem_main(args) == 1
    assert "give --tls-ca" in capsys.readouterr().err
    assert tandem_main(args + ["--tls-ca", pki.ca + ".missing"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_tandem_up_ask_trusts_the_manifests_ca(servers, pki, capsys):
    from tandem.cluster.commands import _ask

    _ask(servers.target, "Hi", 3, KEY, pki.ca)  # what `tandem up --ask` runs once the cluster serves
    out = capsys.readouterr()
    assert out.out.strip().endswith(fake_text(servers.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 3))
    assert "3 tokens" in out.err


# -- the router actor and bad files ------------------------------------------------------------------------

def test_router_actor_serves_both_apis_over_tls(pki, monkeypatch):
    monkeypatch.setattr(router_actor, "load_model_info", lambda path: embedded())  # loaded once per module

    async def scenario():
        replicas = [MockPrefill("prefill-0"), MockDecode("decode-0")]
        ready = [ReadyReplica(r.name, r.pool, r, await r.ready()) for r in replicas]
        actor = router_actor.RouterActor(None, DriverSettings())
        endpoints = await actor.start(ready, "127.0.0.1:0", "127.0.0.1:0",
                                      tls=TLSConfig(pki.server_cert, pki.server_key))
        try:
            async with grpc.aio.secure_channel(endpoints["grpc"], grpc.ssl_channel_credentials(
                    Path(pki.ca).read_bytes())) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=pki.ca)) as http:
                assert (await http.get(f"https://{endpoints['http']}/health")).status_code == 200
        finally:
            await actor.stop(0)

    asyncio.run(scenario())


def test_unusable_files_fail_at_start_naming_the_file(pki, tmp_path):
    other = _write(tmp_path, "other", _issue("other", None))
    cases = [(TLSConfig(str(tmp_path / "absent.pem"), pki.server_key), "cert_file", "cannot read"),
             (TLSConfig(pki.server_key, pki.server_key), "cert_file", "no valid PEM certificate"),
             (TLSConfig(pki.server_cert, other[1]), "key_file", "is not the private key of the certificate"),
             (TLSConfig(pki.server_cert, pki.server_cert), "key_file", "no PEM private key"),
             (TLSConfig(pki.server_cert, pki.server_key, pki.server_key), "client_ca_file", "no valid PEM")]
    for tls, field, needle in cases:
        with pytest.raises(TLSFileError) as caught:
            tls.check()
        assert caught.value.field == field and needle in str(caught.value)

    async def start_both():
        with pytest.raises(TLSFileError):
            await start_grpc_server(TandemServicer(None), "127.0.0.1:0", tls=cases[2][0])
        with pytest.raises(TLSFileError):
            await start_http_server(FastAPI(), "127.0.0.1:0", tls=cases[2][0])

    asyncio.run(start_both())
