"""TLS, mutual TLS, bearer tokens, tenant isolation and quotas, over real TLS connections."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.auth import TokenFileError, TokenStore, hash_token
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.tls import TlsConfigError, is_loopback
from pagedkv.v1 import block_manager_pb2 as pb
from tests.security.conftest import TOKENS, Caller, open_channel

CODE = grpc.StatusCode


def _code(fn, *a, **kw) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        fn(*a, **kw)
    return e.value.code()


# --- TLS ---------------------------------------------------------------------------------------
def test_tls_server_accepts_tls_client_and_rejects_plaintext(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory(mtls=False, auth=False)
    with open_channel(certs, r.port, client_cert=False) as ch:
        assert pb_stats(ch).num_gpu_blocks == 4096
    with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
        assert _code(pb_stats, ch, timeout=2) == CODE.UNAVAILABLE


def pb_stats(ch: grpc.Channel, timeout: float = 10, md=()) -> pb.Stats:  # type: ignore[no-untyped-def]
    from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

    return pb_grpc.BlockManagerStub(ch).GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=md)


def test_mtls_requires_a_client_certificate(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory(auth=False)
    with open_channel(certs, r.port, client_cert=True) as ch:
        assert pb_stats(ch).block_size == 16
    with open_channel(certs, r.port, client_cert=False) as ch:
        assert _code(pb_stats, ch, timeout=3) == CODE.UNAVAILABLE


def test_client_library_speaks_tls_and_tokens(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory()
    with BlockManagerClient(
        f"localhost:{r.port}",
        tls_ca=certs["ca"],
        tls_cert=certs["client"],
        tls_key=certs["client_key"],
        token=TOKENS["alice"],
    ) as c:
        assert list(c.allocate("s", 20).block_ids) == [0, 1]
        assert c.health() == 1


def test_plaintext_on_non_loopback_refuses_to_start() -> None:
    with pytest.raises(TlsConfigError, match="allow-insecure"):
        start_server(BlockManagerSettings(host="0.0.0.0", port=0))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


def test_half_configured_tls_refuses_to_start(certs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TlsConfigError, match="tls_key"):
        start_server(BlockManagerSettings(port=0, tls_cert=certs["server"]))
    with pytest.raises(TlsConfigError, match="cannot read"):
        start_server(BlockManagerSettings(port=0, tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"))


# --- authentication ------------------------------------------------------------------------------
def test_missing_or_invalid_token_is_unauthenticated_health_stays_open(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory()
    with open_channel(certs, r.port) as ch:
        assert _code(pb_stats, ch) == CODE.UNAUTHENTICATED
        assert _code(pb_stats, ch, md=(("authorization", "Bearer wrong"),)) == CODE.UNAUTHENTICATED
        assert (
            _code(pb_stats, ch, md=(("authorization", TOKENS["alice"]),)) == CODE.UNAUTHENTICATED
        )  # no "Bearer"
        anon = Caller(ch, None)
        assert _code(anon.Allocate, pb.AllocateRequest(seq_id="s", num_tokens=4)) == CODE.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert pb_stats(ch, md=(("authorization", f"Bearer {TOKENS['alice']}"),)).block_size == 16
    assert r.servicer._core.stats().num_sequences == 0


def test_permission_denied_for_methods_outside_allow_and_admin_scopes(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory()
    with open_channel(certs, r.port) as ch:
        reader, alice, root = Caller(ch, "reader"), Caller(ch, "alice"), Caller(ch, "root")
        assert reader.GetConfig(pb.GetConfigRequest()).block_size == 16
        assert _code(reader.Allocate, pb.AllocateRequest(seq_id="s", num_tokens=4)) == CODE.PERMISSION_DENIED
        assert _code(alice.GetStats, pb.GetStatsRequest(all_tenants=True)) == CODE.PERMISSION_DENIED
        stream = alice.WatchEvents(pb.WatchEventsRequest(all_tenants=True))
        assert _code(next, stream) == CODE.PERMISSION_DENIED
        assert root.GetStats(pb.GetStatsRequest(all_tenants=True)).num_gpu_blocks == 4096


def test_token_store_is_strict_and_hashes_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "t.toml"
    p.write_text(f'[[tenants]]\nname = "a"\ntoken_sha256 = "{hash_token("x")}"\nmax_sequences = 3\n')
    store = TokenStore.load(p)
    assert store.authenticate("x").max_sequences == 3  # type: ignore[union-attr]
    assert store.authenticate("y") is None
    p.write_text('[[tenants]]\nname = "bad name"\ntoken_sha256 = "00"\n')
    with pytest.raises(TokenFileError, match="name"):
        TokenStore.load(p)
    p.write_text(f'[[tenants]]\nname = "a"\ntoken = "plain"\ntoken_sha256 = "{hash_token("x")}"\n')
    with pytest.raises(TokenFileError, match="unknown keys"):
        TokenStore.load(p)


def test_logs_never_contain_tokens(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    from structlog.testing import capture_logs

    r = secure_factory()
    with capture_logs() as logs, open_channel(certs, r.port) as ch:
        _code(pb_stats, ch, md=(("authorization", "Bearer secret-guess-123"),))
        alice = Caller(ch, "alice")
        _code(alice.Free, pb.FreeRequest(seq_id="nope"))
    text = repr(logs)
    assert "unauthenticated" in text and "request_rejected" in text
    for secret in ("secret-guess-123", TOKENS["alice"], hash_token(TOKENS["alice"])):
        assert secret not in text


# --- tenant isolation -------------------------------------------------------------------------------
def test_sequence_ids_are_per_tenant_and_errors_show_the_clients_id(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory()
    with open_channel(certs, r.port) as ch:
        alice, bob = Caller(ch, "alice"), Caller(ch, "bob")
        a = alice.Allocate(pb.AllocateRequest(seq_id="seq-1", num_tokens=20))
        b = bob.Allocate(pb.AllocateRequest(seq_id="seq-1", num_tokens=4))
        assert len(a.block_ids) == 2 and len(b.block_ids) == 1
        assert len(alice.GetBlockTable(pb.GetBlockTableRequest(seq_id="seq-1")).block_ids) == 2
        assert len(bob.GetBlockTable(pb.GetBlockTableRequest(seq_id="seq-1")).block_ids) == 1
        alice.Allocate(pb.AllocateRequest(seq_id="only-alice", num_tokens=4))
        with pytest.raises(grpc.RpcError) as e:
            bob.Fork(pb.ForkRequest(parent_seq_id="only-alice", child_seq_id="x"))
        assert e.value.code() == CODE.NOT_FOUND
        assert e.value.details() == "parent sequence 'only-alice' does not exist"
        assert "\\x1f" not in e.value.details() and "alice" not in e.value.details().replace("only-alice", "")
        with pytest.raises(grpc.RpcError) as e:
            alice.Allocate(pb.AllocateRequest(seq_id="seq-1", num_tokens=4))
        assert e.value.details() == "sequence 'seq-1' already exists"
        assert _code(bob.Free, pb.FreeRequest(seq_id="only-alice")) == CODE.NOT_FOUND
        # Step errors name the client's ids too.
        resp = bob.Step(pb.StepRequest(append_seq_ids=["seq-1", "only-alice"]))
        assert [(x.seq_id, x.code) for x in resp.errors] == [("only-alice", CODE.NOT_FOUND.value[0])]
        assert "\x1f" not in resp.errors[0].message and "\\x1f" not in resp.errors[0].message
        # Stats: own numbers only, unless admin.
        sa = alice.GetStats(pb.GetStatsRequest())
        sb = bob.GetStats(pb.GetStatsRequest())
        assert (sa.num_sequences, sa.num_used_blocks) == (2, 3)
        assert (sb.num_sequences, sb.num_used_blocks) == (1, 1)
        assert Caller(ch, "root").GetStats(pb.GetStatsRequest()).num_sequences == 3
    r.servicer._core.check_invariants()


def test_prefix_cache_is_salted_per_tenant_and_per_cache_salt(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory()
    prompt = list(range(50))
    with open_channel(certs, r.port) as ch:
        alice, bob = Caller(ch, "alice"), Caller(ch, "bob")
        assert (
            alice.Allocate(pb.AllocateRequest(seq_id="a1", num_tokens=50, token_ids=prompt)).num_cached_tokens
            == 0
        )
        alice.Commit(pb.CommitRequest(seq_id="a1", num_computed_tokens=50))
        assert (
            alice.Allocate(pb.AllocateRequest(seq_id="a2", num_tokens=50, token_ids=prompt)).num_cached_tokens
            == 48
        )
        assert (
            bob.Allocate(pb.AllocateRequest(seq_id="b1", num_tokens=50, token_ids=prompt)).num_cached_tokens
            == 0
        )
        salted = pb.AllocateRequest(seq_id="a3", num_tokens=50, token_ids=prompt, cache_salt="user-7")
        assert alice.Allocate(salted).num_cached_tokens == 0
        alice.Step(pb.StepRequest(commit_seq_ids=["a3"], commit_num_computed_tokens=[50]))
        salted.seq_id = "a4"
        assert alice.Allocate(salted).num_cached_tokens == 48
    r.servicer._core.check_invariants()


# --- quotas ---------------------------------------------------------------------------------------
def test_quotas_name_the_limit_and_change_nothing(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory(
        quotas={"alice": {"max_sequences": 2, "max_gpu_blocks": 5}}, block_size=4, num_gpu_blocks=64
    )
    with open_channel(certs, r.port) as ch:
        alice = Caller(ch, "alice")
        alice.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=12))  # 3 blocks
        with pytest.raises(grpc.RpcError) as e:
            alice.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=12))
        assert e.value.code() == CODE.RESOURCE_EXHAUSTED and "max_gpu_blocks=5" in e.value.details()
        alice.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="a2"))  # shares: costs no block
        with pytest.raises(grpc.RpcError) as e:
            alice.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="a3"))
        assert e.value.code() == CODE.RESOURCE_EXHAUSTED and "max_sequences=2" in e.value.details()
        alice.Append(pb.AppendRequest(seq_id="a", num_tokens=8))  # 2 more blocks: exactly at the quota
        with pytest.raises(grpc.RpcError) as e:
            alice.Append(pb.AppendRequest(seq_id="a", num_tokens=1))
        assert "max_gpu_blocks" in e.value.details()
        before = alice.GetStats(pb.GetStatsRequest())
        assert (before.num_used_blocks, before.num_sequences) == (5, 2)
        # Other tenants are unaffected by alice's quota.
        Caller(ch, "bob").Allocate(pb.AllocateRequest(seq_id="a", num_tokens=40))
        alice.Free(pb.FreeRequest(seq_id="a2"))
        alice.Free(pb.FreeRequest(seq_id="a"))
        assert alice.GetStats(pb.GetStatsRequest()).num_used_blocks == 0
    r.servicer._core.check_invariants()


def test_preemption_never_crosses_tenants(secure_factory, certs) -> None:  # type: ignore[no-untyped-def]
    r = secure_factory(
        quotas={"bob": {"max_gpu_blocks": 10}},
        block_size=4,
        num_gpu_blocks=13,
        num_cpu_blocks=8,
        watermark_fraction=0.0,
        preemption_mode="swap",
    )
    with open_channel(certs, r.port) as ch:
        alice, bob = Caller(ch, "alice"), Caller(ch, "bob")
        alice.Allocate(pb.AllocateRequest(seq_id="low", num_tokens=16, priority=-50))  # the lowest rank
        bob.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=16, priority=10))
        bob.Allocate(pb.AllocateRequest(seq_id="b-low", num_tokens=20, priority=-9))  # pool full (13)
        # bob may only preempt his own sequences: b-low goes, alice's lower-ranked one stays.
        resp = bob.Append(pb.AppendRequest(seq_id="b", num_tokens=1))
        assert [(p.seq_id, p.mode) for p in resp.preempted] == [("b-low", pb.Preemption.SWAP)]
        assert len(alice.GetBlockTable(pb.GetBlockTableRequest(seq_id="low")).block_ids) == 4
        # Over (or about to go over) his quota, bob gets RESOURCE_EXHAUSTED naming it; nothing is preempted.
        bob.Allocate(pb.AllocateRequest(seq_id="b2", num_tokens=16, priority=-9))  # bob 9 of 10, pool full
        with pytest.raises(grpc.RpcError) as e:
            bob.Append(pb.AppendRequest(seq_id="b", num_tokens=8))  # +2 blocks
        assert e.value.code() == CODE.RESOURCE_EXHAUSTED and "max_gpu_blocks=10" in e.value.details()
        assert len(alice.GetBlockTable(pb.GetBlockTableRequest(seq_id="low")).block_ids) == 4
        assert len(bob.GetBlockTable(pb.GetBlockTableRequest(seq_id="b2")).block_ids) == 4
        # alice cannot touch bob's swapped sequence.
        assert _code(alice.SwapIn, pb.SwapInRequest(seq_id="b-low")) == CODE.NOT_FOUND
    r.servicer._core.check_invariants()


def test_tenant_state_survives_a_restart(certs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.security.conftest import write_tokens

    kw = {
        "port": 0,
        "tls_cert": certs["server"],
        "tls_key": certs["server_key"],
        "state_dir": str(tmp_path / "st"),
        "auth_tokens_file": write_tokens(tmp_path / "t.json"),
        "fsync": "off",
    }
    r = start_server(BlockManagerSettings(**kw))
    with open_channel(certs, r.port) as ch:
        Caller(ch, "alice").Allocate(pb.AllocateRequest(seq_id="s", num_tokens=40, token_ids=list(range(40))))
        Caller(ch, "alice").Commit(pb.CommitRequest(seq_id="s", num_computed_tokens=40))
        Caller(ch, "bob").Allocate(pb.AllocateRequest(seq_id="s", num_tokens=4))
    r.stop(0)
    r = start_server(BlockManagerSettings(**kw))
    try:
        with open_channel(certs, r.port) as ch:
            assert len(Caller(ch, "alice").GetBlockTable(pb.GetBlockTableRequest(seq_id="s")).block_ids) == 3
            assert len(Caller(ch, "bob").GetBlockTable(pb.GetBlockTableRequest(seq_id="s")).block_ids) == 1
            assert Caller(ch, "alice").GetStats(pb.GetStatsRequest()).num_used_blocks == 3
            hit = Caller(ch, "alice").Allocate(
                pb.AllocateRequest(seq_id="t", num_tokens=40, token_ids=list(range(40)))
            )
            assert hit.num_cached_tokens == 32
        r.servicer._core.check_invariants()
    finally:
        r.stop(0)


def test_tenant_state_survives_a_crash_through_journal_replay(certs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No snapshot: the restart replays the journal, which must give each admission back its tenant
    (charging, and the tenant as a prefix-hash key) exactly as the live call had it."""
    from tests.block_manager_svc.reliability.conftest import crash
    from tests.security.conftest import write_tokens

    kw = {
        "port": 0,
        "tls_cert": certs["server"],
        "tls_key": certs["server_key"],
        "state_dir": str(tmp_path / "st"),
        "auth_tokens_file": write_tokens(tmp_path / "t.json"),
        "fsync": "always",
        "snapshot_every_ops": 0,
        "snapshot_interval_s": 0,
    }
    r = start_server(BlockManagerSettings(**kw))
    with open_channel(certs, r.port) as ch:
        Caller(ch, "alice").Allocate(pb.AllocateRequest(seq_id="s", num_tokens=40, token_ids=list(range(40))))
        Caller(ch, "alice").Commit(pb.CommitRequest(seq_id="s", num_computed_tokens=40))
        Caller(ch, "bob").Step(pb.StepRequest(alloc_seq_ids=["s"], alloc_num_tokens=[4]))
    crash(r)
    r = start_server(BlockManagerSettings(**kw))
    try:
        assert r.servicer.reliable.recovery.replayed == 3
        core = r.servicer._core
        assert sorted(s.tenant for s in core.seqs.values()) == ["alice", "bob"]
        with open_channel(certs, r.port) as ch:
            assert Caller(ch, "alice").GetStats(pb.GetStatsRequest()).num_used_blocks == 3
            assert Caller(ch, "bob").GetStats(pb.GetStatsRequest()).num_used_blocks == 1
            prompt = list(range(40))
            assert (
                Caller(ch, "bob")
                .Allocate(pb.AllocateRequest(seq_id="t", num_tokens=40, token_ids=prompt))
                .num_cached_tokens
                == 0
            )
            assert (
                Caller(ch, "alice")
                .Allocate(pb.AllocateRequest(seq_id="t", num_tokens=40, token_ids=prompt))
                .num_cached_tokens
                == 32
            )
        core.check_invariants()
    finally:
        r.stop(0)


def test_cache_host_and_worker_servers_speak_mtls(certs) -> None:  # type: ignore[no-untyped-def]
    from pagedkv.grpc_server import start_server as start_worker_server

    r = start_worker_server(
        "127.0.0.1",
        0,
        lambda s: None,
        "pagedkv.v1.Worker",
        tls_cert=certs["server"],
        tls_key=certs["server_key"],
        tls_client_ca=certs["ca"],
    )
    try:
        with open_channel(certs, r.port) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with open_channel(certs, r.port, client_cert=False) as ch:
            assert (
                _code(health_pb2_grpc.HealthStub(ch).Check, health_pb2.HealthCheckRequest(), timeout=3)
                == CODE.UNAVAILABLE
            )
    finally:
        r.stop(0)
    with pytest.raises(TlsConfigError):
        start_worker_server("0.0.0.0", 0, lambda s: None, "pagedkv.v1.Worker")
