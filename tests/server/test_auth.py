"""API keys on every path but /health, the exposure warning, and CORS only when configured."""

import pytest

from server.cli import main
from tests.server.helpers import CHAT, assert_openai_error


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(make_client, tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nfile-key\n\n")
    with make_client(api_keys=["flag-key"], api_key="env-key", api_key_file=key_file) as client:
        yield client


@pytest.mark.parametrize("key", ["flag-key", "env-key", "file-key"])
def test_every_configured_key_is_accepted(keyed, key):
    assert keyed.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
    assert keyed.get("/v1/models", headers=bearer(key)).status_code == 200


# Prefixes, extensions and case changes of a real key are wrong keys too.
@pytest.mark.parametrize("headers", [{}, bearer("wrong"), bearer(""), {"Authorization": "flag-key"},
                                     {"Authorization": "Basic flag-key"}, bearer("flag-key2"),
                                     bearer("f"), bearer("flag-ke"), bearer("FLAG-KEY"),
                                     bearer("lag-key"), bearer("flag-keyflag-key")])
@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                          ("GET", "/metrics"), ("POST", "/bench"),
                                          ("GET", "/v1/no-such-path"), ("GET", "/openapi.json")])
def test_missing_or_wrong_key_is_401_in_the_openai_shape(keyed, headers, method, path):
    resp = keyed.request(method, path, json=CHAT, headers=headers)
    err = assert_openai_error(resp, 401, code="invalid_api_key")
    # A missing key says how to send one; a wrong one says so.
    sent = headers.get("Authorization", "")
    if sent.startswith("Bearer ") and sent[7:].strip():
        assert err["message"] == "the API key is not valid"
    else:
        assert "needs an API key" in err["message"] and "Authorization: Bearer" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert resp.headers["www-authenticate"].startswith("Bearer")
    assert keyed.factory.engines["torch"].calls == []  # nothing reached an engine


@pytest.mark.parametrize("token", ["s", "secret", "secret-ke", "ecret-key", "secret-key ",
                                   "secret-key\x00", "secret-keys"])
def test_only_the_whole_key_matches(token):
    from server.auth import key_matches

    keys = frozenset({b"secret-key", b"other"})
    assert key_matches("secret-key", keys) and key_matches("other", keys)
    assert not key_matches(token, keys)


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.8.0.1", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("192.168.1.20", False),
    ("example.com", False), ("my-mac.local", False), ("", False)])
def test_only_loopback_addresses_count_as_private(host, loopback):
    from server.auth import exposure_warning, is_loopback

    assert is_loopback(host) is loopback
    assert (exposure_warning(host, has_keys=False) is None) is loopback
    assert exposure_warning(host, has_keys=True) is None


def test_health_stays_open(keyed):
    assert keyed.get("/health").json()["status"] == "ok"


def test_without_keys_the_server_is_open(client):
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_an_unreadable_or_empty_key_file_stops_start_up(make_client, tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        make_client(api_key_file=tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        make_client(api_key_file=empty)


@pytest.fixture
def no_serving(monkeypatch):
    served = []
    monkeypatch.setattr("server.cli.run_server", lambda app, settings: served.append(settings))
    return served


def test_a_network_bind_without_a_key_prints_a_loud_warning(models_file, no_serving, capsys):
    assert main(["serve", "--config", str(models_file), "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "0.0.0.0" in err and "--api-key" in err
    assert no_serving[0].host == "0.0.0.0"


@pytest.mark.parametrize("argv", [["--host", "127.0.0.1"], ["--host", "::1"], ["--host", "localhost"],
                                  ["--host", "0.0.0.0", "--api-key", "k"], []])
def test_loopback_or_a_key_means_no_warning(models_file, no_serving, capsys, argv):
    assert main(["serve", "--config", str(models_file), *argv]) == 0
    assert "WARNING" not in capsys.readouterr().err


def test_cli_keys_reach_the_app(models_file, no_serving, tmp_path, monkeypatch):
    key_file = tmp_path / "k"
    key_file.write_text("k3\n")
    monkeypatch.setenv("DUET_API_KEY", "k2")
    assert main(["serve", "--config", str(models_file), "--api-key", "k1", "--api-key",
                 "k1b", "--api-key-file", str(key_file)]) == 0
    assert no_serving[0].accepted_api_keys() == {"k1", "k1b", "k2", "k3"}


def test_cors_is_off_by_default(client):
    resp = client.options("/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in resp.headers
    resp = client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in resp.headers


def test_cors_allows_only_the_configured_origins(make_client):
    with make_client(cors_origins=["http://app.example"], api_keys=["k"]) as client:
        # The preflight carries no key; it must pass before authentication.
        pre = client.options("/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        resp = client.post("/v1/chat/completions", json=CHAT,
                           headers={"Origin": "http://app.example", **bearer("k")})
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == "http://app.example"
        other = client.get("/v1/models", headers={"Origin": "http://evil.example", **bearer("k")})
        assert "access-control-allow-origin" not in other.headers


def test_cors_origins_from_the_environment(monkeypatch):
    from server.settings import Settings

    monkeypatch.setenv("DUET_CORS_ORIGINS", "http://a.example, http://b.example")
    monkeypatch.setenv("DUET_API_KEYS", "one,two")
    settings = Settings()
    assert settings.cors_origins == ["http://a.example", "http://b.example"]
    assert settings.accepted_api_keys() == {"one", "two"}
