"""examples/agentic_rl_lab/search_backend.py: the offline Wikipedia-search stand-in answers the chapter's query
through a CONNECT tunnel with TLS for en.wikipedia.org only, and refuses every other host."""

from __future__ import annotations

import http.client
import importlib.util
import json
import ssl
import threading
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agentic_rl_lab" / "search_backend.py"
QUERY = (
    "/w/api.php?action=query&format=json&formatversion=2&generator=search&gsrsearch=capital+of+Kenya"
    "&gsrlimit=3&prop=extracts%7Cinfo&explaintext=1&exintro=1&exchars=20&inprop=url&redirects=1&utf8=1"
)


def load_backend():
    spec = importlib.util.spec_from_file_location("arl_search_backend", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def backend(tmp_path):
    module = load_backend()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {"title": "Nairobi", "text": "Nairobi is the capital and largest city of Kenya."},
                {"title": "Ottawa", "text": "Ottawa is the capital city of Canada."},
                {"title": "Danube", "text": "The Danube flows into the Black Sea."},
            ]
        )
    )
    ca, cert, key = module.make_certificates(tmp_path / "certs")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    log = tmp_path / "searches.jsonl"
    server = module.SearchServer(("127.0.0.1", 0), module.Corpus(corpus), tls, log)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, ca, log
    finally:
        server.shutdown()
        server.server_close()


def read_pages(connection: http.client.HTTPConnection) -> list[dict]:
    connection.request("GET", QUERY)
    response = connection.getresponse()
    assert response.status == 200
    return json.loads(response.read())["query"]["pages"]


def test_tunnel_answers_the_chapter_query_with_tls_for_the_wikipedia_host(backend):
    server, ca, log = backend
    port = server.server_address[1]
    context = ssl.create_default_context(cafile=str(ca))  # hostname checked against en.wikipedia.org
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    connection.set_tunnel("en.wikipedia.org", 443)
    pages = read_pages(connection)
    connection.close()
    assert [page["title"] for page in pages] == ["Nairobi", "Ottawa"]  # ranked by shared words; Danube shares none
    assert [page["index"] for page in pages] == [1, 2]
    assert pages[0]["extract"] == "Nairobi is the capit"  # exchars=20
    assert pages[0]["fullurl"] == "https://en.wikipedia.org/wiki/Nairobi"
    assert [json.loads(line)["query"] for line in log.read_text().splitlines()] == ["capital of Kenya"]


def test_other_hosts_are_refused_and_a_query_without_hits_has_no_pages(backend):
    server, ca, _ = backend
    port = server.server_address[1]
    context = ssl.create_default_context(cafile=str(ca))
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    connection.set_tunnel("example.com", 443)
    with pytest.raises(OSError, match="403"):
        connection.request("GET", "/")
    connection.close()
    direct = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    direct.request("GET", "/w/api.php?gsrsearch=zebra+giraffe")
    response = direct.getresponse()
    assert response.status == 200
    assert json.loads(response.read()) == {"batchcomplete": True}
    direct.close()
