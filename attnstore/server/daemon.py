"""The daemon's life: bind, load, serve, drain, close.

Order matters. The port is bound and health answers NOT_SERVING before the
store is opened and its indexes are built, so orchestrators see "loading", not
"down". On SIGTERM or SIGINT health turns NOT_SERVING, the server stops taking
calls and lets those in flight finish for ``grace_seconds``, and only when no
call is left in the servicer is the store closed, so no LMDB transaction ever
outlives its environment. SIGHUP reloads the token file (rotation). A watchdog
turns health NOT_SERVING when a background thread of the store dies, so the
orchestrator restarts the daemon instead of leaving it running degraded.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeAlias

from attnstore.errors import AttnStoreError, ChecksumError, ConfigError, StoreDamagedError, StoreNotFoundError
from attnstore.server.auth import TokenTable, load_tokens
from attnstore.server.config import DaemonConfig, split_host_port
from attnstore.server.metrics import DaemonMetrics
from attnstore.server.server import AttnStoreServer, ServerTls, create_server
from attnstore.service import AttnStoreService
from attnstore.service.admission import AdmissionConfig
from attnstore.service.follower import FollowerStatus
from attnstore.store.redis.urls import shown_location
from attnstore.store.reports import StoreStats

if TYPE_CHECKING:
    from attnstore.store.redis.connection import RedisStats

log = logging.getLogger(__name__)

WATCHDOG_THREAD = "attnstore-watchdog"  # the main thread's loop: health, token reloads, signals
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})

# A signal's disposition as signal.signal() takes and returns it: a function,
# SIG_DFL or SIG_IGN, or None (set outside Python).
_SignalHandler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def read_tls(config: DaemonConfig) -> ServerTls | None:
    """The TLS files of ``config`` as PEM bytes, or None without TLS.

    Raises:
        ConfigError: a file cannot be read.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None

    def read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file {path}: {exc.strerror or exc}") from None

    return ServerTls(
        cert_chain=read(config.tls_cert),
        private_key=read(config.tls_key),
        client_ca=read(config.tls_client_ca) if config.tls_client_ca is not None else None,
    )


def _warn_about_exposure(config: DaemonConfig, tokens: TokenTable | None) -> None:
    host, _ = split_host_port(config.listen)
    local = host in _LOOPBACK_HOSTS
    if tokens is None:
        level = logging.WARNING if local else logging.ERROR
        log.log(
            level,
            "event=auth_disabled listen=%s detail='NO TOKEN FILE: anyone who can reach this address can read,"
            " ingest, delete and compact. Pass --token-file to require bearer tokens.'",
            config.listen,
        )
    if not config.tls and not local:
        log.warning(
            "event=plaintext_on_network listen=%s detail='no TLS: tokens and maps cross the network in clear text;"
            " pass --tls-cert and --tls-key'",
            config.listen,
        )


class Daemon:
    """One run of ``attnstore serve``.

    Args:
        config: every setting.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self._config = config
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._service: AttnStoreService | None = None
        self._server: AttnStoreServer | None = None
        self._degraded = False  # a background thread died: health stays NOT_SERVING until restart
        self._watchdog_errors = 0  # unexpected errors of the watchdog's own checks (logged; it goes on)
        self._serving = True  # what health says while not degraded (see _watch_store)
        self._problem: str | None = None  # why the store takes no writes now, as last reported
        self._resets_seen = 0  # store resets the watchdog has reported

    def request_stop(self) -> None:
        """Begin a graceful shutdown (safe from a signal handler or another thread)."""
        self._stop.set()

    def request_reload(self) -> None:
        """Reload the token file at the next tick (safe from a signal handler)."""
        self._reload.set()

    def _store_stats(self) -> StoreStats | None:
        service = self._service
        return None if service is None else service.store.stats()

    def _follower_status(self) -> FollowerStatus | None:
        service = self._service
        return None if service is None else service.monitoring.follower_status()

    def _redis_stats(self) -> RedisStats | None:
        service = self._service
        return None if service is None else service.monitoring.redis_stats()

    def _background_errors(self) -> dict[str, int]:
        service = self._service
        errors = {} if service is None else service.monitoring.background_errors()
        errors[WATCHDOG_THREAD] = self._watchdog_errors
        return errors

    def run(self, *, handle_signals: bool = True) -> int:
        """Serve until asked to stop; returns the exit code (0 after a clean drain).

        Args:
            handle_signals: install SIGTERM/SIGINT (stop) and SIGHUP (reload tokens)
                handlers; only possible on the main thread.

        Raises:
            ConfigError: bad token or TLS files, or the address cannot be bound.
            StoreNotFoundError, StoreOpenError, FormatVersionError: the store cannot be opened.
        """
        config = self._config
        tokens = load_tokens(config.token_file) if config.token_file is not None else None
        tls = read_tls(config)
        _warn_about_exposure(config, tokens)
        previous = self._install_signals() if handle_signals else {}
        metrics = DaemonMetrics(stats=self._store_stats, follower=self._follower_status, redis=self._redis_stats,
                                background=self._background_errors)
        try:
            server, port = create_server(
                None, config.listen, tokens=tokens, tls=tls, limits=config.limits, metrics=metrics
            )
            self._server = server
            server.start()
            host, _ = split_host_port(config.listen)
            address = f"{host}:{port}"
            log.info(
                "event=listening address=%s tls=%s mtls=%s auth=%s health=NOT_SERVING",
                address, config.tls, config.tls_client_ca is not None, tokens is not None,
            )
            try:
                metrics_port = None
                if config.metrics_port is not None:
                    metrics_port = metrics.serve(config.metrics_host, config.metrics_port)
                    log.info("event=metrics_listening address=%s:%d path=/metrics", config.metrics_host, metrics_port)
                self._load()
            except BaseException:
                server.stop(0)
                metrics.stop()
                raise
            server.attach(self._service)
            self._write_ready_file(address, port, metrics_port)
            log.info("event=serving address=%s health=SERVING", address)
            self._wait()
            return self._shutdown(metrics)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _install_signals(self) -> dict[int, _SignalHandler]:
        def on_stop(signum: int, _frame: FrameType | None) -> None:
            self.request_stop()

        def on_reload(signum: int, _frame: FrameType | None) -> None:
            self.request_reload()

        previous: dict[int, _SignalHandler] = {}
        for signum, handler in ((signal.SIGTERM, on_stop), (signal.SIGINT, on_stop), (signal.SIGHUP, on_reload)):
            previous[signum] = signal.signal(signum, handler)
        return previous

    def _load(self) -> None:
        config = self._config
        start = time.perf_counter()
        shown = shown_location(config.store)
        log.info("event=loading store=%s create=%s readonly=%s", shown, config.create, config.readonly)
        try:
            self._service = AttnStoreService.open(
                config.store,
                create=config.create,
                dram_bytes=config.dram_bytes,
                max_bytes=config.max_bytes,
                map_size=config.map_size,
                readonly=config.readonly,
            )
            self._service.use_admission(AdmissionConfig(admit_after=config.admit_after))
            quarantine = self._service.keep_quarantine_in(config.quarantine_path)
            log.info("event=quarantine file=%s objects=%d", config.quarantine_path or "(memory)", len(quarantine))
        except StoreNotFoundError:
            raise StoreNotFoundError(f"no map store at {shown}; serve --create makes an empty one") from None
        except AttnStoreError:
            raise
        except Exception as exc:
            # A damaged store can fail in ways no check anticipated: exit 2 with one line (the CLI's
            # contract for a store that cannot be opened), the traceback in the log at DEBUG.
            log.debug("event=load_failed", exc_info=True)
            raise StoreDamagedError(
                f"the map store at {shown} cannot be loaded ({type(exc).__name__}: {exc}): it is damaged;"
                " restore it from a backup"
            ) from None
        namespaces = self._service.list_namespaces()
        for info in namespaces:
            try:
                self._service.get_namespace(info.name)  # checks the projector against its crc32c
            except ChecksumError as exc:
                log.error("event=projector_damaged namespace=%s detail='%s'", info.name, exc)
        log.info(
            "event=loaded store=%s namespaces=%d seconds=%.3f",
            shown, len(namespaces), time.perf_counter() - start,
        )
        admission = self._service.admission.stats()
        # Who admission counts as one caller (``auth.Caller.key``): without tokens or client certificates only
        # an address, which is no identity (and then any client may write anyway).
        identity = "token" if config.token_file is not None else \
            "certificate" if config.tls_client_ca is not None else "address"
        log.info(
            "event=admission admit_after=%d write_back=%s counts=%s sketch_bytes=%d callers=%s", config.admit_after,
            "on" if config.admit_after else "off", "shared" if admission.shared else "in_memory",
            admission.sketch_bytes, identity,
        )

    def _wait(self) -> None:
        while not self._stop.wait(0.25):
            if self._reload.is_set():
                self._reload.clear()
                self._reload_tokens()
            try:
                self._watch_threads()
                self._watch_store()
            except Exception as exc:
                # The watchdog's checks read the store; a bug there must not end the loop that drains the daemon.
                self._watchdog_errors += 1
                log.error("event=watchdog_error error=%r errors=%d detail='the watchdog goes on'", exc,
                          self._watchdog_errors, exc_info=exc)

    def _watch_threads(self) -> None:
        """Report NOT_SERVING, once, when a background thread of the store has died or its storage
        failed (its directory removed, its database damaged).

        Calls are still answered (a dead prefetch worker only costs speed; a removed
        directory refuses writes itself), but health says NOT_SERVING so that an
        orchestrator drains and restarts the daemon.
        """
        service, server = self._service, self._server
        if self._degraded or service is None or server is None:
            return
        fault = service.monitoring.storage_fault()
        if fault is not None:
            self._degraded = True
            server.set_serving(False)
            log.error("event=storage_fault health=NOT_SERVING detail='%s; restart the daemon on sound storage'", fault)
            return
        dead = service.monitoring.dead_threads()
        if dead:
            self._degraded = True
            server.set_serving(False)
            log.error(
                "event=background_thread_died threads=%s health=NOT_SERVING detail='restart the daemon;"
                " calls are still answered meanwhile'",
                ",".join(dead),
            )

    def _watch_store(self) -> None:
        """Health follows what passes without a restart: a store replaced under the daemon (one tick
        NOT_SERVING, its caches dropped and its indexes rebuilt meanwhile) and a store that takes no writes
        (its marker gone, an unsafe eviction policy: NOT_SERVING while it lasts)."""
        service, server = self._service, self._server
        if self._degraded or service is None or server is None:
            return
        status = service.monitoring.follower_status()
        resets = 0 if status is None else status.resets
        reset, self._resets_seen = resets > self._resets_seen, resets
        if reset:
            log.error("event=store_reset health=NOT_SERVING detail='the store was replaced under this daemon (Redis"
                      " lost its data?): every cache and index of the old one was dropped and rebuilt'")
        problem = service.monitoring.serving_problem()
        if problem != self._problem:
            self._problem = problem
            if problem is not None:
                log.error("event=store_unsafe health=NOT_SERVING detail='%s'", problem)
            else:
                log.warning("event=store_sound health=SERVING detail='the store takes writes again'")
        serving = problem is None and not reset
        if serving != self._serving:
            self._serving = serving
            server.set_serving(serving)

    def _reload_tokens(self) -> None:
        config, server = self._config, self._server
        if config.token_file is None or server is None:
            log.warning("event=reload_ignored reason='no --token-file: auth is disabled'")
            return
        try:
            server.replace_tokens(load_tokens(config.token_file))
        except AttnStoreError as exc:
            log.error("event=reload_failed error=%s detail='the previous tokens stay in force'", exc)

    def _shutdown(self, metrics: DaemonMetrics) -> int:
        config, server = self._config, self._server
        assert server is not None
        log.info("event=draining grace_seconds=%s health=NOT_SERVING", config.grace_seconds)
        start = time.perf_counter()
        idle = server.stop(config.grace_seconds, idle_timeout=config.grace_seconds + 30.0)
        metrics.stop()
        self._remove_ready_file()
        service, self._service = self._service, None
        if not idle:
            # Closing LMDB under a running call could crash; committed data is durable without it.
            log.error("event=stopped_unclean detail='calls still running after the grace period; store left open'")
            return 1
        if service is not None:
            service.close()
        log.info("event=stopped seconds=%.3f", time.perf_counter() - start)
        return 0

    def _write_ready_file(self, address: str, port: int, metrics_port: int | None) -> None:
        path = self._config.ready_file
        if path is None:
            return
        data = {
            "pid": os.getpid(),
            "address": address,
            "port": port,
            "metrics_port": metrics_port,
            "tls": self._config.tls,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)

    def _remove_ready_file(self) -> None:
        path = self._config.ready_file
        if path is not None:
            path.unlink(missing_ok=True)


def run_daemon(config: DaemonConfig) -> int:
    """Run a daemon with ``config`` on the main thread until SIGTERM/SIGINT; returns the exit code."""
    return Daemon(config).run()
