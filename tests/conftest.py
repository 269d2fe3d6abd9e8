"""Test tiers: every collected test gets exactly one of the markers ``unit``, ``e2e`` or ``real_vllm``.

The rule, in order:

1. ``real_vllm``: everything under ``tests/real_vllm/`` (its own conftest adds the marker).
2. A test already marked ``e2e`` or ``unit`` (``@pytest.mark.e2e``) keeps that marker.
3. ``e2e``: a test that starts a process (``kvroute``, ``promtool``, ``kubectl``, a simulated pod), starts a
   server, or opens a network or ZeroMQ socket (loopback included). Whole modules of such tests are listed in
   ``E2E_MODULES``; single tests of otherwise pure modules in ``E2E_TESTS`` (module path -> function names).
   Pure tests that take seconds each (long hypothesis runs, whole published traces) are listed in ``SLOW_TESTS``
   and run with the e2e tier too.
4. ``unit``: everything else. A unit test must be fast and pure: it runs in this process, with no child
   process and no socket, so ``pytest -m unit`` (``make check``) takes seconds.

Rule 4 is enforced, not trusted: while a unit test runs, starting a process and binding or connecting a socket
(TCP, UDP, Unix or a non-inproc ZeroMQ endpoint) raise ``NotAUnitTest``, naming the test and where to list it.
A new test therefore lands in ``unit`` by default and fails at once, with that message, if it is really e2e.
In-process ASGI calls (``httpx.ASGITransport``, Starlette's ``TestClient``) and socket pairs (the event loop's own
wake-up pipe) are allowed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent

# Modules whose every test starts processes or servers or opens sockets.
E2E_MODULES = frozenset({
    "faults/test_event_faults.py",
    "faults/test_pod_faults.py",
    "faults/test_router_faults.py",
    "test_abuse_events.py",
    "test_abuse_router.py",
    "test_abuse_sidecar.py",
    "test_discovery_kubernetes.py",
    "test_e2e_router.py",
    "test_events_cli.py",
    "test_fuzz_http.py",
    "test_index_remote_tokens.py",
    "test_layering.py",
    "test_pd_e2e.py",
    "test_pd_sim.py",
    "test_replicas.py",
    "test_router_api.py",
    "test_router_tokenize_remote.py",
    "test_sidecar.py",
    "test_sidecar_sim.py",
    "test_sim_demo.py",
    "test_sim_events.py",
    "test_sim_faults.py",
    "test_sim_http.py",
    "test_tokenize_process.py",
    "test_upstream.py",
    "test_sim_nixl.py",
    "test_sim_timing.py",
    "test_subscriber.py",
    "test_subscriber_sim.py",
})

# Single e2e tests in modules that are otherwise unit tests (function names, without parameters).
E2E_TESTS: dict[str, frozenset[str]] = {
    "faults/test_watchdog.py": frozenset({"test_an_idle_pod_keeps_its_index_after_requests_that_stored_nothing_new"}),
    "test_booking_bus.py": frozenset({
        "test_bookings_and_releases_propagate_and_a_lost_message_is_repaired_by_the_next_snapshot",
        "test_the_changes_of_one_loop_turn_go_out_as_one_message_applied_in_order",
        "test_a_busy_bus_sends_at_most_one_message_of_changes_per_interval",
        "test_bad_frames_on_the_wire_are_counted_and_the_bus_keeps_working",
        "test_tokenized_chunks_shared_from_another_thread_arrive_split_into_bounded_messages",
        "test_chunks_shared_within_an_interval_leave_together_with_the_bookings_and_the_queue_is_bounded",
        "test_credits_leave_with_the_next_flush_in_bounded_messages_and_the_queue_is_bounded",
        "test_rate_limit_charges_are_summed_per_caller_and_leave_with_the_next_flush",
        "test_a_worker_finds_its_live_siblings_sockets_and_not_its_own",
        "test_workers_reach_each_other_straight_through_their_sockets",
        "test_a_routers_credit_reaches_the_other_routers_index_over_the_bus",
        "test_serve_with_two_workers_sends_every_turn_of_a_conversation_to_its_pod",
        "test_serve_with_two_workers_beside_a_replica_goes_through_the_forwarder",
        "test_a_killed_peer_loses_its_bookings_and_a_restarted_one_does_not_bring_them_back",
        "test_workers_share_bookings_through_the_forwarder",
        "test_serve_with_two_workers_shares_bookings_between_them",
        "test_replicas_follow_the_peer_list_a_resolver_gives",
        "test_two_replicas_with_bind_and_peers_see_each_others_bookings",
        "test_two_replicas_grant_a_keys_rate_limits_once_between_them",
        "test_two_replicas_take_back_a_credit_when_the_pod_refuses_the_request",
        "test_with_a_curve_key_only_its_holders_publish_or_read_bookings",
        "test_a_keyed_forwarder_takes_only_keyed_workers",
    }),
    "test_chat_template_parity.py": frozenset({"test_remote_tokenizer_sends_the_mapped_body_in_its_own_key_order"}),
    "test_cli.py": frozenset({
        "test_help_lists_every_subcommand",
        "test_a_ctrl_c_ends_a_subcommand_with_one_line_and_code_130",
        "test_sigterm_lets_a_stream_run_for_the_shutdown_timeout_then_the_router_exits_cleanly",
    }),
    "test_deploy_kubernetes.py": frozenset({
        "test_hadolint_finds_nothing_in_the_dockerfile",
        "test_hadolint_is_really_linting",
        "test_image_is_multi_stage_slim_non_root_with_healthcheck_and_documented_ports",
        "test_overlay_renders_and_passes_strict_schema_validation",
        "test_schema_validation_rejects_a_broken_manifest",
        "test_every_image_is_pinned_to_a_tag",
        "test_every_reference_resolves_within_the_render",
        "test_router_tier_is_replicated_protected_and_least_privileged",
        "test_router_replicas_share_bookings_through_a_headless_service",
        "test_router_discovers_exactly_the_model_pods_and_reads_them_as_they_listen",
        "test_vllm_overlays_give_the_router_the_model_tokenizer",
        "test_vllm_pods_publish_kv_events_with_replay_where_the_annotations_say",
        "test_vllm_pd_prefill_and_decode_pods_speak_nixl",
        "test_vllm_pd_decode_pods_run_the_sidecar_in_front_of_vllm",
        "test_simulated_pods_run_kvroute_sim_with_events_where_the_annotations_say",
        "test_model_pods_carry_the_discovery_labels_and_annotations",
    }),
    "test_deploy_monitoring.py": frozenset({
        "test_alert_rules_pass_promtool_check",
        "test_alert_rules_unit_tests_pass",
        "test_alert_rule_unit_tests_catch_a_broken_threshold",
        "test_static_scrape_config_passes_promtool_check",
        "test_kubernetes_scrape_config_passes_promtool_check",
        "test_operator_rule_is_generated_from_alerts_yml_and_passes_promtool",
        "test_only_the_router_with_discovery_on_exports_discovery_series",
        "test_every_metric_in_the_alert_rules_is_exported",
        "test_every_metric_on_the_dashboard_is_exported",
        "test_dashboard_configmap_renders_validates_and_carries_the_dashboard",
        "test_operator_monitors_find_the_ports_the_manifests_declare",
        "test_real_prometheus_with_the_kubernetes_config_scrapes_router_sidecar_and_pods",
    }),
    "test_discovery_dns.py": frozenset({
        "test_system_resolver_finds_localhost",
        "test_stub_resolver_answers_a_and_aaaa_and_tells_failure_from_absence",
        "test_resolved_pods_join_serve_and_leave_and_a_failing_resolver_keeps_the_fleet",
    }),
    "test_fuzz_events.py": frozenset({"test_live_subscriber_counts_and_drops_bad_frames_and_keeps_applying_good_ones"}),
    "test_keys.py": frozenset({"test_keys_are_stable_across_processes"}),
    "test_prefix_tokens.py": frozenset({"test_the_router_reuses_prefix_tokens_and_tokenizes_big_prompts_off_the_loop",
                                        "test_chain_keys_are_the_same_in_every_process",
                                        "test_replicas_share_the_chunks_they_tokenize",
                                        "test_a_follow_up_is_tokenized_on_the_loop_from_chunks_the_tokenize_process_stored"}),
    "test_replay_cli.py": frozenset({
        "test_mooncake_replay_writes_table_json_and_plots",
        "test_comma_separated_targets_share_the_requests",
        "test_bad_trace_line_is_a_clear_error_not_a_traceback",
        "test_unreachable_target_and_bad_compare_input",
        "test_workload_after_pod_metrics_is_not_taken_for_a_url",
        "test_help_lists_every_setting",
        "test_mooncake_against_a_simulated_pod",
    }),
    "test_replay_runner.py": frozenset({
        "test_metrics_match_known_timing",
        "test_rejections_count_as_slo_misses",
        "test_slow_ttft_misses_slo_and_slo_header_sent",
        "test_hit_rate_from_pod_metrics",
        "test_max_concurrency_queues_without_counting_as_lateness",
        "test_duration_and_max_requests_limit_what_is_sent",
        "test_dropped_stream_and_unreachable_target_are_errors",
        "test_other_status_and_chat_endpoint_and_model_discovery",
        "test_drain_timeout_cancels_and_counts_unfinished_requests",
        "test_several_targets_take_the_requests_in_turn",
    }),
    "test_router_config.py": frozenset({
        "test_registry_marks_pods_unhealthy_after_n_failures_and_forgets_later",
        "test_serve_cli_documents_every_knob_and_refuses_an_empty_fleet",
        "test_a_bad_setting_stops_start_up_without_echoing_a_secret",
    }),
    "test_security.py": frozenset({
        "test_per_key_request_rate_limit_answers_429_with_retry_after_and_keys_are_separate",
        "test_prompt_token_bucket_limits_big_prompts_per_key",
        "test_client_headers_cannot_choose_the_pod_or_the_prefill_host",
        "test_a_key_limited_to_some_models_uses_and_sees_only_them",
        "test_sighup_reload_revokes_a_key_keeps_the_others_and_no_log_line_holds_a_key",
        "test_tls_listener_serves_https_with_the_configured_certificate",
        "test_tls_settings_come_in_pairs",
    }),
    "test_sidecar_dp.py": frozenset({
        "test_external_lb_port_and_header_pick_the_rank",
        "test_external_lb_refuses_an_endpoint_that_is_not_this_pods",
        "test_internal_lb_sets_the_rank_header",
    }),
    "test_sidecar_app.py": frozenset({
        "test_an_internal_error_is_an_openai_style_500_not_a_trace",
        "test_help_lists_every_setting_and_bad_settings_exit_cleanly",
    }),
}

# Pure tests that take seconds each (hypothesis runs of hundreds of examples, whole published traces): e2e too,
# so the unit tier stays seconds long.
SLOW_TESTS: dict[str, frozenset[str]] = {
    "test_fuzz_events.py": frozenset({
        "test_random_frames_are_refused_with_decode_error_only",
        "test_random_msgpack_payloads_decode_or_are_refused",
        "test_mutated_valid_frames_decode_or_are_refused",
    }),
    "test_index.py": frozenset({"test_index_agrees_with_a_brute_force_model"}),
    "test_prefix_tokens.py": frozenset({"test_cached_prefixes_give_exactly_the_full_tokenization",
                                        "test_branches_that_differ_inside_a_run_of_spaces_stay_exact"}),
    "test_subscriber_property.py": frozenset({"test_index_follows_the_engine_through_gaps_and_restarts"}),
    "test_replay_workloads.py": frozenset({"test_real_mooncake_trace_loads_and_shares_block_zero", "test_azure_trace"}),
    "test_whatif.py": frozenset({
        "test_oracle_is_at_least_as_good_as_every_policy_that_admits_everything",
        "test_predicted_ttft_beats_random_on_a_cache_heavy_workload",
        "test_deterministic_for_a_seed",
    }),
}

TIERS = ("unit", "e2e", "real_vllm")


def _module(item: pytest.Item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()


def _is_e2e(item: pytest.Item) -> bool:
    module = _module(item)
    name = getattr(item, "originalname", item.name)
    return (module in E2E_MODULES or name in E2E_TESTS.get(module, frozenset())
            or name in SLOW_TESTS.get(module, frozenset()))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    collected: dict[str, set[str]] = {}
    for item in items:
        collected.setdefault(_module(item), set()).add(getattr(item, "originalname", item.name))
    for listing in (E2E_TESTS, SLOW_TESTS):
        for module, names in listing.items():
            if module in collected and names - collected[module]:
                warnings.warn(f"tests/conftest.py lists tests that {module} no longer has: "
                              f"{', '.join(sorted(names - collected[module]))}", pytest.PytestWarning, stacklevel=1)
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        if _module(item).startswith("real_vllm/"):
            item.add_marker(pytest.mark.real_vllm)  # as tests/real_vllm/conftest.py does, which runs after this
        else:
            item.add_marker(pytest.mark.e2e if _is_e2e(item) else pytest.mark.unit)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m unit`` alone, skip importing modules that hold no unit test (a faster ``make check``)."""
    if config.getoption("markexpr", "") != "unit":
        return None
    try:
        module = collection_path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None
    return True if module in E2E_MODULES or module == "real_vllm" else None


class NotAUnitTest(AssertionError):
    """A test marked ``unit`` started a process or opened a socket."""


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    nodeid = request.node.nodeid

    def refuse(what: str) -> NotAUnitTest:
        return NotAUnitTest(f"{nodeid} is a unit test but {what}: a test that starts processes or opens sockets "
                            "is e2e; list it in E2E_TESTS or E2E_MODULES in tests/conftest.py")

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise refuse(f"started a process ({args[1] if len(args) > 1 else kwargs.get('args')!r})")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)

    for method in ("bind", "connect", "connect_ex"):

        def guarded(sock: socket.socket, address: Any, _method: str = method) -> Any:
            raise refuse(f"called socket.{_method}({address!r})")

        monkeypatch.setattr(socket.socket, method, guarded)

    zmq = sys.modules.get("zmq")
    if zmq is not None:
        for method in ("bind", "connect"):
            original = getattr(zmq.Socket, method)

            def guarded_zmq(sock: Any, address: str, *args: Any, _original: Any = original, _method: str = method,
                            **kwargs: Any) -> Any:
                if str(address).startswith("inproc://"):
                    return _original(sock, address, *args, **kwargs)
                raise refuse(f"called zmq socket.{_method}({address!r})")

            monkeypatch.setattr(zmq.Socket, method, guarded_zmq)
    yield
