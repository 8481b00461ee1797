"""API keys: the router's Authenticator (router/auth.py), the tenant salt that keeps tenants' prefix caches apart,
and the manifest's auth section (cluster/manifest.py) with the check `tandem validate` / `tandem up` run on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.cluster.manifest import ApiKey, AuthSettings
from tandem.cluster.manifest_checks import check_manifest, validate_file
from tandem.cluster.manifest_yaml import ManifestInvalid, line_map, parse_manifest, read_yaml
from tandem.engine.kv.prefix_cache import block_hashes
from tandem.router.auth import Authenticator, Unauthenticated, cache_salt_for

KEYS = {"sk-acme-0123456789": "acme", "sk-globex-9876543210": "globex"}


# --- Authenticator ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "", "Bearer nonsense", "Basic abc", "whatever"])
def test_without_keys_everyone_is_let_in_as_no_tenant(authorization):
    for auth in (Authenticator(), Authenticator({}), Authenticator(None)):
        assert not auth.enabled
        assert auth.tenant(authorization) is None


def test_each_key_authenticates_as_its_tenant():
    auth = Authenticator(KEYS)
    assert auth.enabled
    assert auth.tenant("Bearer sk-acme-0123456789") == "acme"
    assert auth.tenant("Bearer sk-globex-9876543210") == "globex"


@pytest.mark.parametrize("authorization", ["bearer sk-acme-0123456789", "BEARER sk-acme-0123456789",
                                           "  Bearer sk-acme-0123456789  ", "Bearer    sk-acme-0123456789",
                                           "Bearer sk-acme-0123456789\n"])
def test_the_scheme_is_case_insensitive_and_whitespace_is_tolerated(authorization):
    assert Authenticator(KEYS).tenant(authorization) == "acme"


@pytest.mark.parametrize("authorization", [None, ""])
def test_a_missing_key_is_refused(authorization):
    with pytest.raises(Unauthenticated, match=r"missing API key: send `Authorization: Bearer <key>`"):
        Authenticator(KEYS).tenant(authorization)


@pytest.mark.parametrize("authorization", ["Basic sk-acme-0123456789", "sk-acme-0123456789", "Token sk-acme-0123456789",
                                           "Bearer", "Bearer ", "Bearer    ", "   "])
def test_another_scheme_or_an_empty_key_is_malformed(authorization):
    with pytest.raises(Unauthenticated, match=r"malformed authorization: expected `Bearer <key>`"):
        Authenticator(KEYS).tenant(authorization)


@pytest.mark.parametrize("key", ["sk-acme-012345678", "sk-acme-01234567890", "SK-ACME-0123456789", "sk-other-key",
                                 "sk-acme-0123456789sk-globex-9876543210", "sk-äcme-0123456789"])
def test_a_key_that_is_not_configured_is_invalid(key):
    with pytest.raises(Unauthenticated, match=r"^invalid API key$"):
        Authenticator(KEYS).tenant(f"Bearer {key}")


def test_the_three_refusals_say_different_things():
    auth = Authenticator(KEYS)
    messages = set()
    for authorization in (None, "Basic x", "Bearer wrong-key"):
        with pytest.raises(Unauthenticated) as info:
            auth.tenant(authorization)
        messages.add(str(info.value))
    assert len(messages) == 3


def test_cache_salt_separates_tenants():
    assert cache_salt_for(None) is None
    acme, globex = cache_salt_for("acme"), cache_salt_for("globex")
    assert acme is not None and globex is not None and acme != globex
    assert cache_salt_for("acme") == acme  # stable: a tenant's own requests keep sharing its cache
    # What a user notices: the same prompt hashes to different blocks per tenant, and to unsalted ones without.
    prompt = list(range(32))
    hashes = {t: block_hashes(prompt, 16, cache_salt_for(t)) for t in (None, "acme", "globex")}
    assert len({h for hs in hashes.values() for h in hs}) == 6


# --- the manifest's auth section -------------------------------------------------------------------------------------


def test_an_api_key_takes_exactly_one_source(tmp_path):
    assert ApiKey(tenant="acme", key="sk-acme-0123456789").resolve() == "sk-acme-0123456789"
    with pytest.raises(ValidationError, match=r"give exactly one of key, key_env or key_file \(got none\)"):
        ApiKey(tenant="acme")
    with pytest.raises(ValidationError, match=r"give exactly one of key, key_env or key_file \(got key, key_env\)"):
        ApiKey(tenant="acme", key="sk-acme-0123456789", key_env="ACME_API_KEY")
    with pytest.raises(ValidationError, match=r"\(got key_env, key_file\)"):
        ApiKey(tenant="acme", key_env="ACME_API_KEY", key_file=str(tmp_path / "key"))


def test_an_api_key_is_long_enough_and_has_a_tenant():
    with pytest.raises(ValidationError, match="at least 8 characters"):
        ApiKey(tenant="acme", key="short")
    with pytest.raises(ValidationError, match="tenant"):
        ApiKey(tenant="", key="sk-acme-0123456789")
    with pytest.raises(ValidationError, match="api_key"):
        AuthSettings.model_validate({"api_keys": [{"tenant": "acme", "key": "sk-acme-0123456789", "api_key": "x"}]})


def test_a_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_ACME_KEY", "  sk-acme-0123456789\n")
    assert ApiKey(tenant="acme", key_env="TANDEM_TEST_ACME_KEY").resolve() == "sk-acme-0123456789"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_an_unset_or_blank_variable_is_named(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TANDEM_TEST_ACME_KEY", raising=False)
    else:
        monkeypatch.setenv("TANDEM_TEST_ACME_KEY", value)
    with pytest.raises(ValueError, match=r"^environment variable TANDEM_TEST_ACME_KEY \(the key of tenant 'acme'\) "
                                         r"is not set$"):
        ApiKey(tenant="acme", key_env="TANDEM_TEST_ACME_KEY").resolve()


def test_a_key_from_a_file(tmp_path):
    path = tmp_path / "acme.key"
    path.write_text("sk-acme-0123456789\n")
    assert ApiKey(tenant="acme", key_file=str(path)).resolve() == "sk-acme-0123456789"


def test_a_missing_or_empty_key_file_is_named(tmp_path):
    absent = tmp_path / "absent.key"
    with pytest.raises(ValueError, match=rf"^cannot read the key of tenant 'acme' from {absent}: "
                                         r"No such file or directory$"):
        ApiKey(tenant="acme", key_file=str(absent)).resolve()
    with pytest.raises(ValueError, match=r"cannot read the key of tenant 'acme' from .*: Is a directory"):
        ApiKey(tenant="acme", key_file=str(tmp_path)).resolve()
    empty = tmp_path / "empty.key"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match=rf"^{empty} \(the key of tenant 'acme'\) is empty$"):
        ApiKey(tenant="acme", key_file=str(empty)).resolve()


def test_auth_settings_resolve_every_key_to_its_tenant(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_TEST_GLOBEX_KEY", "sk-globex-9876543210")
    key_file = tmp_path / "initech.key"
    key_file.write_text("sk-initech-5555555555")
    settings = AuthSettings(api_keys=[ApiKey(tenant="acme", key="sk-acme-0123456789"),
                                      ApiKey(tenant="acme", key="sk-acme-second-key"),  # a tenant may have two
                                      ApiKey(tenant="globex", key_env="TANDEM_TEST_GLOBEX_KEY"),
                                      ApiKey(tenant="initech", key_file=str(key_file))])
    keys = settings.resolve()
    assert keys == {"sk-acme-0123456789": "acme", "sk-acme-second-key": "acme",
                    "sk-globex-9876543210": "globex", "sk-initech-5555555555": "initech"}
    # ... and those are the keys the router lets in.
    auth = Authenticator(keys)
    assert [auth.tenant(f"Bearer {k}") for k in keys] == list(keys.values())
    assert AuthSettings().resolve() == {} and not Authenticator(AuthSettings().resolve()).enabled


def test_the_same_key_for_two_tenants_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_GLOBEX_KEY", "sk-shared-0123456789")  # the same key, from another source
    settings = AuthSettings(api_keys=[ApiKey(tenant="acme", key="sk-shared-0123456789"),
                                      ApiKey(tenant="globex", key_env="TANDEM_TEST_GLOBEX_KEY")])
    with pytest.raises(ValueError, match=r"^tenants 'acme' and 'globex' have the same API key$"):
        settings.resolve()


# --- `tandem validate` on a manifest with keys -----------------------------------------------------------------------


@pytest.fixture
def fast_embedded(embedded_shape_once):
    """check_manifest loads the embedded model's shape once for the session (tests/conftest.py)."""


WITH_KEYS = """\
mode: colocated
pools:
  decode: {{}}
auth:
  api_keys:
    - {{tenant: acme, key: sk-acme-0123456789}}
    - {{tenant: globex, key_env: TANDEM_TEST_GLOBEX_KEY}}
    - tenant: initech
      key_file: {key_file}
"""


def _manifest(tmp_path: Path, key_file: Path) -> Path:
    path = tmp_path / "manifest.yaml"
    path.write_text(WITH_KEYS.format(key_file=key_file))
    return path


def test_a_manifest_whose_keys_resolve_is_valid(tmp_path, monkeypatch, fast_embedded):
    monkeypatch.setenv("TANDEM_TEST_GLOBEX_KEY", "sk-globex-9876543210")
    key_file = tmp_path / "initech.key"
    key_file.write_text("sk-initech-5555555555\n")
    manifest = validate_file(_manifest(tmp_path, key_file), check_ports=False)
    assert manifest.auth.resolve() == {"sk-acme-0123456789": "acme", "sk-globex-9876543210": "globex",
                                       "sk-initech-5555555555": "initech"}
    assert parse_manifest("pools: {decode: {}}\nmode: colocated\n").auth.api_keys == []


def test_validate_reports_an_unset_variable_and_a_missing_file_at_their_entries(tmp_path, monkeypatch,
                                                                                 fast_embedded):
    monkeypatch.delenv("TANDEM_TEST_GLOBEX_KEY", raising=False)
    absent = tmp_path / "initech.key"
    path = _manifest(tmp_path, absent)
    with pytest.raises(ManifestInvalid) as info:
        validate_file(path, check_ports=False)
    errors = info.value.errors
    assert [e.path for e in errors] == ["auth.api_keys.1", "auth.api_keys.2"]
    assert errors[0].message == "environment variable TANDEM_TEST_GLOBEX_KEY (the key of tenant 'globex') is not set"
    assert errors[1].message.startswith(f"cannot read the key of tenant 'initech' from {absent}")
    assert all("`tandem up`" in e.hint for e in errors)
    assert all(e.line is not None for e in errors)
    assert "auth.api_keys.1: environment variable TANDEM_TEST_GLOBEX_KEY" in str(info.value)


def test_validate_points_at_the_line_of_the_entry_that_fails(tmp_path, monkeypatch, fast_embedded):
    monkeypatch.delenv("TANDEM_TEST_GLOBEX_KEY", raising=False)
    key_file = tmp_path / "initech.key"
    key_file.write_text("sk-initech-5555555555")
    with pytest.raises(ManifestInvalid) as info:
        validate_file(_manifest(tmp_path, key_file), check_ports=False)
    [error] = info.value.errors
    assert (error.path, error.line) == ("auth.api_keys.1", 7)


def test_check_manifest_on_parsed_yaml(tmp_path, monkeypatch, fast_embedded):
    monkeypatch.delenv("TANDEM_TEST_GLOBEX_KEY", raising=False)
    key_file = tmp_path / "initech.key"
    key_file.write_text("sk-initech-5555555555")
    text = WITH_KEYS.format(key_file=key_file)
    data = read_yaml(text)
    [error] = check_manifest(data, line_map(text), check_ports=False)
    assert error.path == "auth.api_keys.1"
    assert "TANDEM_TEST_GLOBEX_KEY" in error.message
    monkeypatch.setenv("TANDEM_TEST_GLOBEX_KEY", "sk-globex-9876543210")
    assert check_manifest(data, line_map(text), check_ports=False) == []


def test_a_key_entry_with_two_sources_is_reported_once_by_the_schema(tmp_path, fast_embedded):
    path = tmp_path / "manifest.yaml"
    path.write_text("mode: colocated\npools:\n  decode: {}\nauth:\n  api_keys:\n"
                    "    - {tenant: acme, key: sk-acme-0123456789, key_env: ACME_API_KEY}\n")
    with pytest.raises(ManifestInvalid) as info:
        validate_file(path, check_ports=False)
    [error] = info.value.errors
    assert (error.path, error.line) == ("auth.api_keys.0", 6)
    assert "give exactly one of key, key_env or key_file (got key, key_env)" in error.message
