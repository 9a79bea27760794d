"""An offline stand-in for the Wikipedia search that 03-search-r1's ``--search-backend wikipedia`` calls.

The chapter's ``WikipediaSearchClient`` sends ``GET https://en.wikipedia.org/w/api.php?action=query&generator=search
&gsrsearch=<query>&gsrlimit=3&prop=extracts|info...`` with ``urllib`` and reads ``query.pages[*]`` (``index``,
``title``, ``extract``, ``fullurl``). Its address is fixed in the code, but ``urllib`` honours the standard proxy and
CA variables, so the script runs unmodified against this process:

    python examples/agentic_rl_lab/search_backend.py --corpus /tmp/arl-data/search_r1/corpus.jsonl \\
        --port 8791 --cert-dir /tmp/arl-certs --log /tmp/arl-searches.jsonl
    export https_proxy=http://127.0.0.1:8791 SSL_CERT_FILE=/tmp/arl-certs/ca.pem no_proxy=127.0.0.1,localhost

It is an HTTP proxy that accepts ``CONNECT en.wikipedia.org:443`` only (any other host is refused with 403 and
never contacted: nothing leaves this machine), ends the tunnel's TLS itself with a certificate for that host
signed by a CA it creates in ``--cert-dir`` (``SSL_CERT_FILE`` makes the client trust that CA, and only it), and
answers ``/w/api.php`` searches from ``--corpus`` (JSONL of ``title`` and ``text``), ranked by how many query words
a document contains. A plain ``GET http://127.0.0.1:<port>/w/api.php?...`` answers the same, for checks with
``curl``. Every search is printed and appended to ``--log`` as one JSON line (query, titles returned).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

HOST = "en.wikipedia.org"
WORD = re.compile(r"[a-z0-9]+")
STOP_WORDS = frozenset("a an and by for in is it of on the to was what where which who whom with".split())


def words(text: str) -> set[str]:
    return {word for word in WORD.findall(text.lower()) if word not in STOP_WORDS}


class Corpus:
    """Documents ranked by query-word overlap (title words count twice); ties keep file order."""

    def __init__(self, path: Path) -> None:
        self.documents: list[dict[str, str]] = []
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row.get("title"), str) or not isinstance(row.get("text"), str):
                    raise SystemExit(f"error: {path}:{number}: each line needs string 'title' and 'text'")
                self.documents.append({"title": row["title"], "text": row["text"]})
        if not self.documents:
            raise SystemExit(f"error: {path} holds no documents")
        self._title_words = [words(doc["title"]) for doc in self.documents]
        self._text_words = [words(doc["text"]) for doc in self.documents]

    def search(self, query: str, limit: int) -> list[dict[str, str]]:
        wanted = words(query)
        scored = []
        for index, doc in enumerate(self.documents):
            score = 2 * len(wanted & self._title_words[index]) + len(wanted & self._text_words[index])
            if score > 0:
                scored.append((-score, index, doc))
        scored.sort(key=lambda item: (item[0], item[1]))
        return [doc for _, _, doc in scored[:limit]]


def api_answer(corpus: Corpus, params: dict[str, list[str]]) -> dict:
    """The subset of the MediaWiki Action API answer that the chapter reads (formatversion=2)."""
    query = params.get("gsrsearch", [""])[0]
    try:
        limit = max(1, min(int(params.get("gsrlimit", ["3"])[0]), 10))
    except ValueError:
        limit = 3
    try:
        chars = max(1, int(params.get("exchars", ["1200"])[0]))
    except ValueError:
        chars = 1200
    hits = corpus.search(query, limit)
    if not hits:
        return {"batchcomplete": True}
    pages = [
        {
            "pageid": 1000 + corpus.documents.index(doc),
            "ns": 0,
            "title": doc["title"],
            "index": rank,
            "extract": doc["text"][:chars],
            "fullurl": f"https://{HOST}/wiki/{quote(doc['title'].replace(' ', '_'))}",
        }
        for rank, doc in enumerate(hits, 1)
    ]
    return {"batchcomplete": True, "query": {"pages": pages}}


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a leaf certificate for HOST signed by it (kept in folder; reused when present)."""
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "leaf.pem", folder / "leaf-key.pem"
    if ca_path.exists() and cert_path.exists() and key_path.exists():
        return ca_path, cert_path, key_path
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentic-rl-lab offline search stand-in CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]))
        .issuer_name(ca_name)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(leaf_cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return ca_path, cert_path, key_path


class SearchServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, corpus: Corpus, tls: ssl.SSLContext, log_path: Path | None) -> None:
        super().__init__(address, ProxyHandler)
        self.corpus = corpus
        self.tls = tls
        self.log_path = log_path
        self.log_lock = threading.Lock()
        self.count = 0

    def record(self, query: str, titles: list[str]) -> None:
        with self.log_lock:
            self.count += 1
            line = json.dumps({"n": self.count, "query": query, "titles": titles}, ensure_ascii=False)
            print(f"search {line}", flush=True)
            if self.log_path is not None:
                with self.log_path.open("a", encoding="utf-8") as file:
                    file.write(line + "\n")


class ApiHandler(BaseHTTPRequestHandler):
    """Answers /w/api.php (direct, or inside the CONNECT tunnel)."""

    server: SearchServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path != "/w/api.php":
            self.reply(404, {"error": {"code": "notfound", "info": f"no such path {url.path}"}})
            return
        params = parse_qs(url.query)
        answer = api_answer(self.server.corpus, params)
        titles = [page["title"] for page in answer.get("query", {}).get("pages", [])]
        self.server.record(params.get("gsrsearch", [""])[0], titles)
        self.reply(200, answer)

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ProxyHandler(ApiHandler):
    def do_CONNECT(self) -> None:
        host, _, port = self.path.partition(":")
        if host.lower() != HOST or port not in ("", "443"):
            self.send_error(403, f"this stand-in answers {HOST}:443 only")
            return
        self.send_response(200, "Connection Established")
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.wfile.flush()
        try:
            tunnel = self.server.tls.wrap_socket(self.connection, server_side=True)
        except (ssl.SSLError, OSError) as error:
            print(f"TLS handshake failed: {error}", flush=True)
            self.close_connection = True
            return
        ApiHandler(tunnel, self.client_address, self.server)
        self.close_connection = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="JSONL of {'title', 'text'} documents")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--cert-dir", type=Path, required=True, help="folder for the CA (ca.pem) and leaf files")
    parser.add_argument("--log", type=Path, default=None, help="append each search here as a JSON line")
    args = parser.parse_args()
    corpus = Corpus(args.corpus)
    ca_path, cert_path, key_path = make_certificates(args.cert_dir)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert_path, key_path)
    server = SearchServer((args.host, args.port), corpus, tls, args.log)
    server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(f"search stand-in for https://{HOST}/w/api.php: {len(corpus.documents)} documents", flush=True)
    print(f"  export https_proxy=http://{args.host}:{server.server_address[1]} SSL_CERT_FILE={ca_path}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
