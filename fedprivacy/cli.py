"""Command line: ``fedprivacy run | compare | report | epsilon | calibrate | audit | data generate | data stats``.

Errors a user can fix (bad config field, missing or corrupt data file, existing or busy run folder,
a file-system error such as a full disk) print one clear line naming the field or file and exit
with status 2, without a traceback; Ctrl-C exits with 130 and the command that resumes the run.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import shlex
import sys
from typing import Any
from pathlib import Path

from fedprivacy.config import ConfigError, RunConfig, build_config, check_plugins, load_config

# fedprivacy.audit.BROKEN_VARIANTS, kept import-free
BROKEN_VARIANT_NAMES = ("noise_off", "noise_halved", "realised_divisor", "clip_after_sum", "noise_after_optimizer",
                        "double_clip_half_noise", "noise_over_cohort")

EXIT_USAGE = 2
EXIT_AUDIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C

_OS_ERROR_HINTS = {errno.ENOSPC: "free some space and rerun; --resume continues from the last checkpoint",
                   errno.EACCES: "check the permissions", errno.EPERM: "check the permissions",
                   errno.EROFS: "choose a writable location", errno.EEXIST: "a file is in the way of a folder",
                   errno.ENOTDIR: "a file is in the way of a folder"}


def describe_os_error(err: OSError) -> str:
    """One line: the path, the problem and (for common ones) what to do; an error without a path as it reads."""
    if err.filename is None:
        return str(err)
    hint = _OS_ERROR_HINTS.get(err.errno)
    return f"{err.filename}: {err.strerror or err}" + (f" ({hint})" if hint else "")


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The command's config: its file (else the defaults) with ``--set``; a plug-in only with ``--allow-plugins``."""
    cfg = load_config(args.config, args.set) if args.config else build_config({}, args.set, source="defaults")
    check_plugins(cfg, args.allow_plugins)
    return cfg


TRACKERS = ("tensorboard", "mlflow")


def trackers(text: str) -> list[str]:
    """``--track``'s value: a comma-separated list of :data:`TRACKERS` (the fields of the ``tracking`` section)."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown tracker {unknown[0]!r} (choose from {', '.join(TRACKERS)}, "
                                         "comma-separated)")
    return names


def _cmd_run(args: argparse.Namespace) -> int:
    from fedprivacy.outputs import CHECKPOINT
    from fedprivacy.run import prepare_data, run

    from fedprivacy.experiments.progress import RunProgress

    args.set = [*args.set, *(f"tracking.{name}=true" for name in args.track)]
    cfg = _run_config(args)
    try:
        prepare_data(cfg, args.resume)  # its progress bars, before the run's own display
        with RunProgress(cfg.rounds, cfg.privacy.budget_accountant, mode="off" if args.quiet else None) as progress:
            summary = run(cfg, resume=args.resume, on_round=progress.round_done)
            progress.run_done(summary)
    except KeyboardInterrupt:
        if (Path(cfg.output_dir) / CHECKPOINT).is_file():
            command = ["fedprivacy", "run", *([args.config] if args.config else []),
                       *(f"--set={a}" for a in args.set), "--resume"]
            print(f"fedprivacy: interrupted; resume the run with: {shlex.join(command)}", file=sys.stderr)
        else:
            print("fedprivacy: interrupted before the run's first checkpoint; rerun the same command to start it",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedprivacy.experiments import compare, load_study
    from fedprivacy.experiments.study import expand
    from fedprivacy.experiments.sweep import SweepBusyError

    study = load_study(args.config, [*args.set, *(f"base.tracking.{name}=true" for name in args.track)])
    for spec in expand(study):
        check_plugins(spec.config, args.allow_plugins)
    try:
        result, report = compare(study, args.jobs)
    except SweepBusyError as err:
        print(f"fedprivacy: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"fedprivacy: interrupted; rerun the same command to continue (finished runs are kept, "
              f"interrupted ones resume from their checkpoints in {study.output_dir}/runs)", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"runs: {len(result.done)} run now, {len(result.skipped)} already finished, {len(result.failed)} failed")
    for run_id, error in result.failed.items():
        print(f"  FAILED {run_id}: {error}", file=sys.stderr)
    print(f"report: {report}")
    return 1 if result.failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from fedprivacy.experiments import write_report
    from fedprivacy.experiments.docs import export_summary, stale_tables, update_docs
    from fedprivacy.experiments.results import load_results

    if (args.run_dir is None) == (not args.docs):
        print("fedprivacy: error: report takes a study folder or --docs FILE..., not both", file=sys.stderr)
        return EXIT_USAGE
    if args.run_dir is not None and (Path(args.run_dir) / "summary.json").is_file():  # one run's folder
        from fedprivacy.experiments.canary_report import estimates_line, export_run_summary, read_run_summary

        print(estimates_line(read_run_summary(args.run_dir)["empirical_epsilon"]))
        if args.summary:
            print(f"summary: {export_run_summary(args.run_dir, args.summary)}")
        return 0
    if args.run_dir is not None:
        print(f"report: {write_report(args.run_dir)}")
        if args.summary:
            print(f"summary: {export_summary(load_results(args.run_dir), args.summary)}")
        return 0
    stale = 0
    for doc in args.docs:
        if args.check:
            names = stale_tables(doc, args.results)
            stale += len(names)
            for name in names:
                print(f"fedprivacy: {doc}: table {name} differs from {args.results}/{name.split(':')[0]}.json "
                      "(regenerate with: fedprivacy report --docs " + doc + ")", file=sys.stderr)
        elif update_docs(doc, args.results):
            print(f"updated: {doc}")
    return 1 if stale else 0


def _scheduled(args: argparse.Namespace) -> bool:
    """Whether the command accounts a cyclic schedule or a correlated mechanism (the mechanism's planned events)."""
    return args.sampling in ("cyclic_poisson", "min_separated") or args.mechanism != "independent"


def _planned_epsilon(args: argparse.Namespace, noise_multiplier: float, steps: int, kind: str,
                     orders: list[float] | None = None) -> float | None:
    """Epsilon of ``steps`` releases of the mechanism the arguments describe (:func:`planned_ledger`)."""
    from fedprivacy.privacy.accounting import epsilon
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from fedprivacy.privacy.mechanism import planned_ledger
    from fedprivacy.privacy.noise import GaussianNoise

    if args.population is None:
        raise ValueError(f"--population is required for --sampling {args.sampling} and --mechanism {args.mechanism}")
    stream: Any = GaussianNoise
    if args.mechanism != "independent":
        stream = CorrelatedMechanism(kind=args.mechanism, horizon=args.horizon or steps, groups=args.groups,
                                     bands=args.bands, buffers=args.buffers,
                                     amplified=args.mechanism == "bandmf" and args.sampling == "cyclic_poisson")
    ledger = planned_ledger(noise_multiplier, steps, expected_cohort=round(args.q * args.population),
                            population=args.population, sampling=args.sampling, groups=args.groups,
                            noise_stream=stream)
    return epsilon(ledger, args.delta, kind, rdp_orders=orders)  # type: ignore[arg-type]


def _cmd_epsilon(args: argparse.Namespace) -> int:
    """Each accountant's epsilon >= 0; ``"inf"`` when there is none (z = 0), ``null`` when it cannot account."""
    from fedprivacy.privacy.accounting import epsilon_for, json_epsilon

    kinds = ["rdp", "prv", "pld"] if args.accountant == "all" else [args.accountant]
    orders = [float(o) for o in args.orders.split(",")] if args.orders else None
    if args.skellam_dim is not None:
        return _skellam_epsilon(args, kinds, orders)
    result = {
        "sampling": args.sampling, "q": args.q, "noise_multiplier": args.noise_multiplier,
        "steps": args.steps, "delta": args.delta, "population": args.population,
        "epsilon": {k: json_epsilon(
            _planned_epsilon(args, args.noise_multiplier, args.steps, k, orders) if _scheduled(args) else
            epsilon_for(args.sampling, args.q, args.noise_multiplier, args.steps, args.delta, k,
                        population=args.population, rdp_orders=orders)) for k in kinds},
    }
    if _scheduled(args):
        result.update(groups=args.groups, mechanism=args.mechanism)
    print(json.dumps(result, indent=2, allow_nan=False))
    return 0


def _skellam_epsilon(args: argparse.Namespace, kinds: list[str], orders: list[float] | None) -> int:
    """``epsilon`` of the distributed Skellam mechanism under secure aggregation: ``--steps`` rounds of a model of
    ``--skellam-dim`` values, each with the shares of its survivors (``--survivors``, default all ``m``)."""
    from fedprivacy.privacy.accounting import PrivacyLedger, epsilon, json_epsilon
    from fedprivacy.privacy.skellam import SkellamParams

    if args.sampling != "poisson" or args.expected_cohort is None:
        raise ValueError("--skellam-dim needs --sampling poisson and --expected-cohort (the m shares of the noise)")
    params = SkellamParams(dim=args.skellam_dim, clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier,
                           expected_cohort=args.expected_cohort, bits=args.bits)
    survivors = [int(n) for n in args.survivors.split(",")] if args.survivors else [args.expected_cohort]
    if len(survivors) not in (1, args.steps) or not all(1 <= n for n in survivors):
        raise ValueError(f"--survivors: one count >= 1, or one per step ({args.steps}), got {args.survivors!r}")
    ledger = PrivacyLedger()
    for step in range(args.steps):
        ledger.compose(params.event(survivors[step if len(survivors) > 1 else 0], args.q))
    result = {"mechanism": "skellam", "sampling": "poisson", "q": args.q, "noise_multiplier": args.noise_multiplier,
              "steps": args.steps, "delta": args.delta, "dim": args.skellam_dim, "bits": args.bits,
              "expected_cohort": args.expected_cohort, "survivors": survivors, "scale": params.scale,
              "l2_sensitivity": params.l2_sensitivity, "l1_sensitivity": params.l1_sensitivity,
              "epsilon": {k: json_epsilon(epsilon(ledger, args.delta, k, rdp_orders=orders))  # type: ignore[arg-type]
                          for k in kinds}}
    print(json.dumps(result, indent=2, allow_nan=False))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from fedprivacy.privacy.calibration import calibrate_noise_multiplier, max_rounds

    if (args.steps is None) == (args.noise_multiplier is None):
        raise ValueError("calibrate needs exactly one of --steps (find the noise multiplier) or "
                         "--noise-multiplier (find the affordable steps)")
    if _scheduled(args):
        return _calibrate_scheduled(args)
    if args.sampling == "fixed" and args.population is None:
        raise ValueError("--population is required for --sampling fixed")
    population = args.population or 1  # poisson/none without N: expected cohort q * 1 of 1
    cohort = round(args.q * population) if args.sampling == "fixed" else args.q * population
    common = {"sampling": args.sampling, "population": population, "expected_cohort": cohort,
              "accountant": args.accountant}
    result = {"sampling": args.sampling, "q": args.q, "population": args.population, "delta": args.delta,
              "target_epsilon": args.target_epsilon, "accountant": args.accountant}
    if args.steps is not None:
        z = calibrate_noise_multiplier(args.target_epsilon, args.delta, rounds=args.steps, **common)
        result.update(steps=args.steps, noise_multiplier=z)
    else:
        steps = max_rounds(args.target_epsilon, args.delta, noise_multiplier=args.noise_multiplier, **common)
        result.update(noise_multiplier=args.noise_multiplier, steps=steps)
    from fedprivacy.privacy.accounting import epsilon_for, json_epsilon

    result["epsilon"] = json_epsilon(epsilon_for(args.sampling, args.q, result["noise_multiplier"], result["steps"],
                                                 args.delta, args.accountant, population=args.population))
    print(json.dumps(result, indent=2))
    return 0


def _calibrate_scheduled(args: argparse.Namespace) -> int:
    """``calibrate`` for a cyclic schedule or a correlated mechanism, on its planned events."""
    from fedprivacy.privacy.accounting import json_epsilon
    from fedprivacy.privacy.calibration import solve_noise_multiplier

    def eps(z: float, steps: int) -> float:
        value = _planned_epsilon(args, z, steps, args.accountant)
        if value is None:
            raise ValueError(f"--accountant {args.accountant} cannot account --mechanism {args.mechanism}: use rdp or pld")
        return value

    result = {"sampling": args.sampling, "groups": args.groups, "mechanism": args.mechanism, "q": args.q,
              "population": args.population, "delta": args.delta, "target_epsilon": args.target_epsilon,
              "accountant": args.accountant}
    if args.steps is not None:
        z = solve_noise_multiplier(lambda z: eps(z, args.steps), args.target_epsilon, accountant=args.accountant,
                                   delta=args.delta)
        result.update(steps=args.steps, noise_multiplier=z)
    else:  # the largest T with eps(T) <= target: double, then bisect (eps does not decrease with T)
        z, lo, hi = args.noise_multiplier, 0, 1
        while eps(z, hi) <= args.target_epsilon:
            lo, hi = hi, 2 * hi
            if hi > 1_000_000:
                raise ValueError("more than 1,000,000 steps fit the budget: nothing to calibrate")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if eps(z, mid) <= args.target_epsilon else (lo, mid)
        if lo == 0:
            raise ValueError(f"not even one step fits target_epsilon={args.target_epsilon} at noise multiplier {z}")
        result.update(noise_multiplier=z, steps=lo)
    result["epsilon"] = json_epsilon(eps(result["noise_multiplier"], result["steps"]))
    print(json.dumps(result, indent=2))
    return 0


def _add_mechanism_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=1, help="b of the cyclic samplings (their min separation)")
    p.add_argument("--mechanism", choices=["independent", "tree", "bandmf", "blt"], default="independent",
                   help="noise across rounds (default: independent); correlated ones need a cyclic --sampling")
    p.add_argument("--horizon", type=int, help="releases one correlated strategy covers (default: --steps)")
    p.add_argument("--bands", type=int, default=4, help="BandMF's bands (<= --groups)")
    p.add_argument("--buffers", type=int, default=3, help="BLT's buffers")


def _cmd_deploy_local(args: argparse.Namespace) -> int:
    from fedprivacy.deploy.local import DeploymentError, deploy_local
    from fedprivacy.devices import check_run_device

    cfg = _run_config(args)
    check_run_device(cfg)  # the SuperNodes run here too
    try:
        summary = deploy_local(cfg, args.supernodes, secure=not args.insecure, reproducible=args.reproducible,
                               resume=args.resume, secure_aggregation=args.secure_aggregation,
                               timeout=args.timeout, on_supernode_exit=args.on_supernode_exit, echo=args.stream)
    except DeploymentError as err:
        print(f"fedprivacy: deployment failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedprivacy: interrupted; the deployment was shut down", file=sys.stderr)
        return 130
    if summary.get("empirical_epsilon"):  # privacy.canaries: its estimates beside the accountant's epsilon
        from fedprivacy.experiments.canary_report import estimates_line

        print(estimates_line(summary["empirical_epsilon"]), file=sys.stderr)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from fedprivacy.audit import run_audit
    from fedprivacy.devices import check_run_device

    cfg = _run_config(args)
    check_run_device(cfg)
    report = run_audit(cfg, trials=args.trials, delta=args.delta, alpha=args.alpha, variant=args.break_variant,
                       accountant=args.accountant)
    print(json.dumps(report.as_dict(), indent=2))
    if not report.passed:
        print(f"fedprivacy: audit FAILED: empirical epsilon >= {report.epsilon_lower_bound:.3f} exceeds the claimed "
              f"{report.epsilon_claimed:.3f} ({report.ratio_to_claim:.2f}x; {report.accountant}, one round, "
              f"delta={report.delta:g})", file=sys.stderr)
        return EXIT_AUDIT_FAILED
    return 0


def _cmd_data_generate(args: argparse.Namespace) -> int:
    from fedprivacy.data.synthetic import generate

    files = generate(Path(args.out), num_clients=args.clients, seed=args.seed, overwrite=args.overwrite,
                     format=args.format)
    written = {"sqlite": files.sqlite} if files.sqlite is not None else {f"h5_{k}": v for k, v in files.h5.items()}
    written |= {"word_count": files.word_count, "tag_count": files.tag_count}
    print(json.dumps({k: str(v) for k, v in written.items()}, indent=2))
    return 0


def _cmd_data_stats(args: argparse.Namespace) -> int:
    from fedprivacy.data.sources import open_source

    print(json.dumps({"source": args.source, "splits": open_source(args.source, args.path).stats()}, indent=2))
    return 0


def _cmd_data_download(args: argparse.Namespace) -> int:
    """Exit 1 (one line naming the URL or file) when a download fails; a rerun resumes it."""
    from fedprivacy.data.download import DownloadError, download

    try:
        files = download(Path(args.out), args.format, base_url=args.base_url)
    except DownloadError as err:
        print(f"fedprivacy: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedprivacy: interrupted; rerun the same command to resume the download", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps({name: str(path) for name, path in files.items()}, indent=2))
    return 0


def _track(parser: argparse.ArgumentParser, section: str) -> None:
    parser.add_argument("--track", type=trackers, default=[], metavar="tensorboard,mlflow",
                        help=f"also log each round and the config to TensorBoard and/or MLflow (sets {section}."
                             "tensorboard / .mlflow; the tracking extra; docs/TRACKING.md)")


def _allow_plugins(parser: argparse.ArgumentParser) -> None:
    """The opt-in of a command that runs a config (:func:`~fedprivacy.config.check_plugins`)."""
    parser.add_argument("--allow-plugins", action="store_true",
                        help="run a config naming a plug-in (data.task, privacy.noise_stream, privacy.aggregation, "
                             "privacy.sampling or server.optimizer as module:factory): it imports and runs that code, so pass it only "
                             "for a config you trust")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedprivacy", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run one federated training (default: the embedded quickstart)")
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in quickstart defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set privacy.noise_multiplier=0 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its checkpoint")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress display or lines and no per-round log (warnings only); the JSON summary still "
                        "goes to stdout")
    _track(p, "tracking")
    _allow_plugins(p)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("compare", help="run a study: methods x privacy budgets x seeds x hyperparameter grid, in "
                                       "parallel and resumably; writes tables, figures and a report")
    p.add_argument("config", help="study YAML (see configs/study_*.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a study field, e.g. --set seeds=[0] --set base.rounds=5 (repeatable)")
    p.add_argument("--jobs", type=int, help="runs in parallel (default: the number of usable CPU cores; when the "
                                            "runs use CUDA, the number of GPUs, one worker per GPU)")
    _track(p, "base.tracking")
    _allow_plugins(p)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("report", help="regenerate a study's tables, figures and report.md from its stored runs, "
                                      "or print one run's canary estimates")
    p.add_argument("run_dir", nargs="?", help="the study's output folder (holds study.json), or one run's folder "
                                              "(holds summary.json; a run with privacy.canaries)")
    p.add_argument("--summary", metavar="JSON", help="also write the study's stored summary (one record per "
                                                     "finished run), e.g. docs/results/<study>.json; for a run's "
                                                     "folder its canary estimates, e.g. "
                                                     "docs/results/canaries_<name>.json")
    p.add_argument("--docs", nargs="+", metavar="FILE", help="instead: regenerate the tables marked "
                   "<!-- table:NAME --> ... <!-- /table:NAME --> in these Markdown files from --results/NAME.json")
    p.add_argument("--results", default="docs/results", help="folder of the stored summaries (default: docs/results)")
    p.add_argument("--check", action="store_true", help="with --docs: change nothing, exit 1 if a table differs")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("epsilon", help="epsilon of the (subsampled) Gaussian mechanism, as JSON")
    p.add_argument("--sampling", choices=["poisson", "fixed", "none", "cyclic_poisson", "min_separated"],
                   required=True)
    _add_mechanism_arguments(p)
    p.add_argument("--q", type=float, required=True, help="sampling rate (fixed: cohort / population)")
    p.add_argument("--noise-multiplier", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--accountant", choices=["rdp", "prv", "pld", "all"], default="all")
    p.add_argument("--population", type=int, help="N (required for --sampling fixed)")
    p.add_argument("--orders", help="comma-separated RDP orders (default: Opacus's)")
    p.add_argument("--skellam-dim", type=int, help="account the distributed Skellam mechanism under secure "
                   "aggregation (privacy.secure_aggregation) for a model of this many values (RDP only)")
    p.add_argument("--bits", type=int, default=20, help="Skellam: the modulus bit width")
    p.add_argument("--clip-norm", type=float, default=1.0, help="Skellam: C (the scale depends on it)")
    p.add_argument("--expected-cohort", type=int, help="Skellam: m, the shares that make up the planned noise")
    p.add_argument("--survivors", help="Skellam: clients whose share reached the server, one count for every step "
                   "or a comma-separated count per step (default: m)")
    p.set_defaults(func=_cmd_epsilon)

    p = sub.add_parser("calibrate", help="noise multiplier for a budget (--steps), or the steps a noise "
                                         "multiplier affords (--noise-multiplier), as JSON")
    p.add_argument("--target-epsilon", type=float, required=True)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--sampling", choices=["poisson", "fixed", "none", "cyclic_poisson", "min_separated"],
                   required=True)
    _add_mechanism_arguments(p)
    p.add_argument("--q", type=float, required=True, help="sampling rate (fixed: cohort / population)")
    p.add_argument("--population", type=int, help="N (required for --sampling fixed)")
    p.add_argument("--accountant", choices=["rdp", "prv", "pld"], default="rdp")
    p.add_argument("--steps", type=int, help="rounds the run will take: find the noise multiplier")
    p.add_argument("--noise-multiplier", type=float, help="find the largest affordable number of rounds")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("deploy", help="run on real Flower processes (SuperLink + SuperNodes)")
    deploy_sub = p.add_subparsers(dest="deploy_command", required=True)
    d = deploy_sub.add_parser("local", help="a SuperLink and N SuperNodes on localhost, one user per SuperNode "
                                            "(docs/DEPLOYMENT.md)")
    d.add_argument("config", nargs="?", help="YAML config (default: the built-in quickstart defaults)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    d.add_argument("--supernodes", type=int, required=True, help="number of SuperNodes = the deployment's population "
                                                  "(the first N users of the data set)")
    d.add_argument("--insecure", action="store_true",
                   help="plain HTTP and no SuperNode authentication (default: generated TLS certificates + auth)")
    d.add_argument("--reproducible", action="store_true",
                   help="seed the server's noise and cohort from the config's seed (default: the OS's "
                        "cryptographic source; the SuperNodes' noise is always secret)")
    d.add_argument("--resume", action="store_true", help="continue the run in output_dir from its checkpoint")
    d.add_argument("--secure-aggregation", action="store_true",
                   help="SecAgg+ with distributed Skellam noise: placement distributed, the config's "
                        "privacy.secure_aggregation or threshold/neighbours sized for the cohort (docs/DEPLOYMENT.md)")
    d.add_argument("--timeout", type=float, help="abort (and shut everything down) after this many seconds")
    d.add_argument("--on-supernode-exit", choices=["continue", "restart", "abort"], default="continue",
                   help="a SuperNode that exits: its client drops out (continue), it is restarted and rejoins, "
                        "or the deployment stops (default: continue)")
    d.add_argument("--stream", action="store_true", help="echo Flower's streamed run log (default: one line per round)")
    _allow_plugins(d)
    d.set_defaults(func=_cmd_deploy_local)

    p = sub.add_parser("audit", help="empirical lower bound on one round's epsilon from a canary client "
                                     "(Gaussian fit and threshold test); exits 1 when it exceeds the claimed epsilon")
    p.add_argument("config", nargs="?", help="YAML config whose mechanism and server optimizer are audited")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--trials", type=int, default=500,
                   help="trial pairs (canary in / out) per audit cohort; each pair is two server rounds")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--alpha", type=float, default=0.05, help="the bound holds with probability 1 - alpha")
    p.add_argument("--accountant", choices=["rdp", "prv", "pld"], default="pld", help="accountant of the claim")
    p.add_argument("--break", dest="break_variant", default="correct",
                   choices=["correct", *sorted(BROKEN_VARIANT_NAMES)],
                   help="audit a deliberately broken server instead, to see the audit fail")
    _allow_plugins(p)
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser("data", help="data sets")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    g = data_sub.add_parser("generate", help="write synthetic StackOverflow data in TFF's SQLite or HDF5 format")
    g.add_argument("--out", required=True, help="output folder")
    g.add_argument("--clients", type=int, default=RunConfig().data.synthetic_clients, help="training users")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--format", choices=["tff-sqlite", "tff-h5"], default="tff-sqlite",
                   help="stackoverflow.sqlite, or TFF's legacy stackoverflow_{train,held_out,test}.h5")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(func=_cmd_data_generate)
    g = data_sub.add_parser("stats", help="clients and examples per split of StackOverflow files, as JSON")
    g.add_argument("--source", choices=["tff-sqlite", "tff-h5"], required=True)
    g.add_argument("--path", required=True, help="folder of the files (or, for tff-sqlite, the .sqlite file)")
    g.set_defaults(func=_cmd_data_stats)
    g = data_sub.add_parser("download", help="fetch TFF's StackOverflow files (resumable, SHA-256 checked) into "
                                             "a folder for --set data.path=DIR")
    g.add_argument("--out", required=True, help="output folder (data.path)")
    g.add_argument("--format", choices=["tff-sqlite", "tff-h5"], default="tff-sqlite",
                   help="stackoverflow.sqlite, or TFF's legacy stackoverflow_{train,held_out,test}.h5 (data.source)")
    g.add_argument("--base-url", help="where the archives are: a mirror with the same file names (default: "
                                      "TFF's https://storage.googleapis.com/tff-datasets-public/)")
    g.set_defaults(func=_cmd_data_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = getattr(args, "quiet", False)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from fedprivacy.data.stackoverflow import DataFormatError
    from fedprivacy.locks import FolderBusyError
    from fedprivacy.outputs import RunExistsError

    try:
        return args.func(args)
    except OSError as err:  # FileNotFoundError, PermissionError, a full disk, ...: the path and the problem
        print(f"fedprivacy: error: {describe_os_error(err)}", file=sys.stderr)
        return EXIT_USAGE
    except (ConfigError, DataFormatError, RunExistsError, FolderBusyError, ValueError) as err:
        print(f"fedprivacy: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def run_study_script(script: str, study_file: str) -> None:
    """Body of a ``simulations/`` entry point: ``fedprivacy compare <repo>/configs/<study_file>`` with the
    script's own command-line arguments (``--jobs``, ``--set``), then exit with its status."""
    study = Path(script).resolve().parents[1] / "configs" / study_file
    sys.exit(main(["compare", str(study), *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())

