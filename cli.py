"""`andromeda`: the command line of andromeda-nb. It parses options and prints; the work is in the
library: the migration layer (`migration`) where both architectures meet, the architectures themselves
(`cpu_baseline`, `gpu`) and the shared core (`andromeda_nb`). Data goes to stdout, progress and logs to
stderr."""

from __future__ import annotations

import os

import click

from andromeda_nb.constants import DEFAULT_LAYOUT, LAUNCHES, LAYOUTS, MAX_K, PRECISIONS
from andromeda_nb.devices import DEVICES

_PRECISION = click.Choice(list(PRECISIONS))
_SEED = click.IntRange(0)  # numpy's generators take non-negative seeds
_ADS = click.IntRange(1)  # --ads N: ads in a corpus or pool, one at least wherever it is asked


class _Command(click.Command):
    """A command that still takes the option names it had before a rename (`renamed`), for one release:
    an old name on the command line is read as its new one, with a one-line notice on stderr; `--help`
    shows the new names and lists the old ones at its end."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.renamed = dict(getattr(self.callback, "__renamed__", {}))  # old name -> _Rename

    def parse_args(self, ctx, args):
        if self.renamed:
            args = _renamed_args(" ".join(["andromeda", *ctx.command_path.split()[1:]]), args, self.renamed)
        return super().parse_args(ctx, args)

    def format_epilog(self, ctx, formatter):
        super().format_epilog(ctx, formatter)
        if self.renamed:
            with formatter.section("Old option names (accepted until the next release)"):
                formatter.write_dl([(old, f"now {rename.now}") for old, rename in self.renamed.items()])


class _Rename:
    """Where an old option name goes: `new`, or `pick(value)` when the old name's value decides it."""

    def __init__(self, new: str, pick=None, now: str | None = None):
        self.new, self.pick, self.now = new, pick, now or new

    def target(self, value: str | None) -> str:
        return self.pick(value) if self.pick is not None and value is not None else self.new


def renamed(old: str, new: str, *, pick=None, now: str | None = None):
    """Declare that a command's option `old` is now `new` (its values unchanged): the old name is still
    accepted for one release, with a deprecation line on stderr. `pick(value)` chooses the new name by
    the value where the old name stood for two (`query --requests`: a file or a corpus directory);
    `now` is what the notice and --help say it became."""

    def decorate(f):
        f.__renamed__ = {old: _Rename(new, pick, now), **getattr(f, "__renamed__", {})}
        return f

    return decorate


def _renamed_args(command: str, args: list[str], renames: dict) -> list[str]:
    """`args` with every old option name replaced by its new one (also in --old=VALUE form), each old
    name said once on stderr; nothing after "--" is touched."""
    out, said = [], set()
    i = 0
    while i < len(args):
        token = args[i]
        if not isinstance(token, str):  # a value passed as a number by a caller in Python
            out.append(token)
            i += 1
            continue
        if token == "--":
            out.extend(args[i:])
            break
        name, eq, value = token.partition("=")
        rename = renames.get(name) if token.startswith("--") else None
        if rename is None:
            out.append(token)
        else:
            given = value if eq else (args[i + 1] if i + 1 < len(args) else None)
            new = rename.target(given)
            out.append(new + eq + value)
            if name not in said:
                said.add(name)
                click.echo(f"{command}: {name} is deprecated (it goes in the next release): use {rename.now}",
                           err=True)
        i += 1
    return out


class _Cli(click.Group):
    """The command group: a service that fails during a run (compare, demo, retrieve against the
    services they start) ends the command with its message, never a traceback. Its commands take
    their old option names for a release (`_Command`)."""

    command_class = _Command
    group_class = type

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as exc:
            message = _service_failure(exc)
            if message is None:
                raise
            raise click.ClickException(message) from None


def _service_failure(exc: BaseException) -> str | None:
    """A Flight error's message (its first line, without gRPC's debug context), or None when `exc`
    is not one."""
    if not type(exc).__module__.startswith("pyarrow"):
        return None
    import pyarrow.flight as flight

    if not isinstance(exc, flight.FlightError):
        return None
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "a service failed: " + text.split(". Detail:")[0].split(". gRPC client debug context")[0]


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="andromeda-nb")
def main():
    """GPU ads retrieval by model-system co-design: run, compare and measure a remote-scoring CPU
    architecture and a co-located GPU one on the same corpus."""
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)


# --- shared helpers --------------------------------------------------------------------------------


class _Progress:
    """A click progress bar on stderr (nothing with --quiet); call it with the number of items done."""

    def __init__(self, label: str, length: int, quiet: bool):
        import sys

        self._bar = None if quiet or length <= 0 else click.progressbar(
            length=length, label=label, file=sys.stderr, show_pos=True)

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _info(message: str, quiet: bool = False) -> None:
    if not quiet:
        click.echo(message, err=True)


def _stamp(result: dict, kind: str | None) -> dict:
    """Add "kind" and "provenance" (the command, its options, the time, host and versions) to a result,
    so `andromeda bench report` can show each figure with what made it (`kind` None: the result keeps
    its own)."""
    from andromeda_nb.provenance import stamp_from_click

    return stamp_from_click(result, kind)


def _load_dataset(data: str, quiet: bool):
    from andromeda_nb.store import StoreError, load_dataset, read_meta

    try:
        counts = read_meta(data)["counts"]
        with _Progress("loading corpus", int(counts.get("ads", 0)) + int(counts.get("requests", 0)), quiet) as bar:
            return load_dataset(data, progress=bar)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _apply_updates(path, targets, dataset, quiet: bool) -> None:
    if path is None:
        return
    from andromeda_nb.answers import apply_updates_file
    from andromeda_nb.updates import nothing_applied

    applied, rejections = apply_updates_file(path, targets, dataset)
    _info(f"updates: {applied} applied, {len(rejections)} rejected", quiet)
    for r in rejections:  # rejections are reported even with --quiet
        click.echo(f"  rejected update {r}", err=True)
    problem = nothing_applied(path, applied, rejections)
    if problem:
        raise click.ClickException(problem)


def _write_json(result: dict, out, quiet: bool) -> None:
    if out:
        from andromeda_nb.measure import write_json

        write_json(result, out)
        _info(f"wrote {out}", quiet)


# --- options several commands share ----------------------------------------------------------------


def _prepare_simulator(ctx, param, device: str) -> str:
    """--device sim must be chosen before anything imports numba.cuda (`andromeda_nb.devices`)."""
    from andromeda_nb.devices import prepare

    prepare(device)
    return device


def _output_folder(ctx, param, value):
    """An --out folder, checked before any work: it can be created and written (`store.check_output_dir`)."""
    if value is not None:
        from andromeda_nb.store import StoreError, check_output_dir

        try:
            check_output_dir(value)
        except StoreError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return value


def _output_file(ctx, param, value):
    """An --out file, checked before any work: its folder can be created and written."""
    if value is not None:
        import os

        from andromeda_nb.store import StoreError, check_output_dir

        try:
            check_output_dir(os.path.dirname(os.path.abspath(value)))
        except StoreError as exc:
            raise click.BadParameter(f"{value}: {exc}", ctx, param) from None
    return value


def _quiet_notices(ctx, quiet: bool) -> bool:
    """--quiet also holds back the library's one-line notices (`andromeda_nb.devices.notice`: a device
    fallback, say) for as long as the command runs."""
    if quiet:
        from andromeda_nb import devices
        from andromeda_nb.progress import nowhere

        previous = devices.notice_sink
        devices.notice_sink = nowhere
        ctx.call_on_close(lambda: setattr(devices, "notice_sink", previous))
    return quiet


def _word_list(value, choices):
    """'a,b' -> ('a', 'b'); each one of `choices`, none twice."""
    if isinstance(value, tuple):
        return value
    words = tuple(w.strip() for w in str(value).split(",") if w.strip())
    bad = [w for w in words if w not in choices]
    if not words or bad or len(set(words)) != len(words):
        raise click.BadParameter(f"{value!r}: a comma-separated list of {', '.join(choices)}, each once")
    return words


def _layout_list(value):
    """'format,geo' -> ('format', 'geo'); each a slot layout, none twice."""
    return _word_list(value, LAYOUTS)


def _link(latency_us: float, gbps: float | None):
    """The `relay.Link` of compare's --link-latency-us and --link-gbps."""
    from serving.relay import Link

    return Link(latency_s=latency_us * 1e-6, bandwidth_bps=None if gbps is None else gbps * 1e9)


def _device_list(value):
    """'cpu,auto' -> ('cpu', 'auto'); each a device word."""
    if isinstance(value, tuple):
        return value
    words = tuple(w.strip() for w in str(value).split(",") if w.strip())
    bad = [w for w in words if w not in DEVICES]
    if not words or bad:
        raise click.BadParameter(f"{value!r}: a comma-separated list of {', '.join(DEVICES)}")
    return words


def device_option(help: str, choices=DEVICES):
    """--device: where the work runs (`andromeda_nb.devices`); the simulator is chosen while parsing."""
    return click.option("--device", type=click.Choice(list(choices)), default="auto", show_default=True, help=help,
                        callback=_prepare_simulator)


class NumberList(click.ParamType):
    """Comma-separated numbers of one kind, each checked: `IntList` (positive integers, e.g. "64,128")
    and `ShareList` (shares in (0, 1], e.g. "1,0.08")."""

    name = "numbers"
    parse, kind, wanted = float, "numbers", "numbers"

    def ok(self, x) -> bool:
        return True

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            values = [self.parse(x) for x in str(value).split(",") if x.strip()]
        except ValueError:
            self.fail(f"expected comma-separated {self.kind}, got {value!r}", param, ctx)
        if not values or not all(self.ok(x) for x in values):
            self.fail(f"expected {self.wanted}, got {value!r}", param, ctx)
        return values


class IntList(NumberList):
    name = "integers"
    parse, kind, wanted = int, "integers", "positive integers"

    def ok(self, x) -> bool:
        return x > 0


class CountList(IntList):
    name = "counts"
    wanted = "whole numbers of at least 0"

    def ok(self, x) -> bool:
        return x >= 0


class ShareList(NumberList):
    name = "shares"
    wanted = "shares in (0, 1]"

    def ok(self, x) -> bool:
        return 0.0 < x <= 1.0


def int_list_option(*names, default=None, help: str):
    """An option holding comma-separated positive integers (validated the same way everywhere)."""
    return click.option(*names, type=IntList(), default=default, show_default=default is not None, help=help)


def k_option(help: str = f"Answers per request (1..{MAX_K}).", default: int = 100):
    return click.option("--k", "k", type=click.IntRange(1, MAX_K), default=default, show_default=True, help=help)


_DATA_OPTION = click.option("--data", "data", required=True, type=click.Path(exists=True, file_okay=False),
                            help="Corpus directory (made by `generate` or `import`).")
_UPDATES_FILE = click.option("--updates-file", "updates", type=click.Path(exists=True, dir_okay=False), default=None,
                             help="JSON Lines update stream (DESIGN section 6) applied before answering.")


def _UPDATES_OPTION(f):
    """--updates-file FILE (once --updates, which is a count in `generate`)."""
    return renamed("--updates", "--updates-file")(_UPDATES_FILE(f))


_JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="JSON Lines on stdout: one object per line.")
_QUIET_OPTION = click.option("--quiet", "-q", is_flag=True, callback=lambda c, p, v: _quiet_notices(c, v),
                             help="No progress or log lines on stderr.")
_BENCH_JSON_OPTION = click.option("--json", "as_json", is_flag=True,
                                  help="JSON Lines on stdout: the result as one line, instead of the table.")
_SHARDS_OPTION = click.option("--shards", type=click.IntRange(1, 1024), default=None,
                               help="Shards the pool is split into by a hash of the ad id (--arch sharded; default 2).")
_REPLICAS_OPTION = click.option("--replicas", type=click.IntRange(1, 64), default=1, show_default=True,
                                help="Replicas of every shard (a request asks one; updates go to all).")
_ADDRESS_OPTION = click.option("--address", default=None,
                               help="Join the running Ray cluster at this address (ray://HOST:PORT or HOST:PORT) "
                                    "instead of starting a local one.")
_FORCE_OPTION = click.option("--force", is_flag=True, help="Replace the corpus OUT already holds.")
_OUT_FILE = click.option("--out-file", "out", type=click.Path(dir_okay=False), default=None, callback=_output_file,
                         help="Also write the result, as JSON, to this file.")


def _OUT_JSON_OPTION(f):
    """A bench's --out-file FILE (once --out, which is a directory in every other command)."""
    return renamed("--out", "--out-file")(_OUT_FILE(f))


# --- corpus commands -------------------------------------------------------------------------------


@main.command()
@click.option("--ads", "n_ads", type=_ADS, default=100_000, show_default=True, help="Number of ads.")
@click.option("--requests", "n_requests", type=click.IntRange(0), default=100, show_default=True,
              help="Number of requests.")
@click.option("--seed", type=_SEED, default=0, show_default=True, help="Corpus seed (same seed, same files).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), callback=_output_folder,
              help="Output directory.")
@click.option("--precision", type=_PRECISION, default="fp32", show_default=True,
              help="How embeddings are stored.")
@click.option("--dim", type=click.IntRange(1, 4096), default=64, show_default=True, help="Embedding dimension D.")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="Processes that make ads (default: up to 2; the files do not depend on it).")
@click.option("--updates", "n_updates", type=click.IntRange(0), default=0, show_default=True,
              help="Also write OUT/updates.jsonl: this many seeded, valid updates (creates, replacements, "
                   "status changes, retirements) for --updates-file of match, retrieve and compare.")
@_FORCE_OPTION
@_JSON_OPTION
@_QUIET_OPTION
def generate(n_ads, n_requests, seed, out, precision, dim, workers, n_updates, force, as_json, quiet):
    """Write a seeded synthetic corpus: Parquet ads and requests, model.npz and meta.json.

    Prints how much of the pool a request finds eligible (min / p10 / median / p90 / max over
    requests), checked with the oracle on an evenly spaced sample of ads when the pool is large. An
    OUT that already holds a corpus is replaced only with --force.
    """
    import json
    import os
    import time

    from andromeda_nb import corpus
    from andromeda_nb.answers import fraction_summary
    from andromeda_nb.store import StoreError, refuse_existing_corpus

    try:
        refuse_existing_corpus(out, force)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    start = time.perf_counter()
    with _Progress("generating ads", n_ads, quiet) as bar:
        summary = corpus.generate_corpus(out, n_ads, n_requests, seed, dim=dim, precision=precision,
                                         workers=workers, progress=bar)
    seconds = time.perf_counter() - start
    _info(f"wrote {n_ads} ads and {n_requests} requests to {out} in {seconds:.1f} s (seed {seed})", quiet)
    if n_updates:
        path = corpus.write_update_stream(out, n_updates, seed, dim=dim)
        _info(f"wrote {n_updates} updates to {path}", quiet)
    fractions = corpus.eligible_fractions(summary.sample_ads, summary.request_objects, seed, dim=dim)
    dist = fraction_summary(fractions)
    report = {"out": out, "ads": n_ads, "requests": n_requests, "seed": seed, "precision": precision, "dim": dim,
              "seconds": round(seconds, 3), "eligible_fraction": dist, "updates": n_updates,
              "eligible_sample": {"ads": len(summary.sample_ads), "requests": len(fractions)}}
    if as_json:
        click.echo(json.dumps(report))
        return
    if not dist:
        click.echo("no requests or no ads: no eligible-fraction distribution")
        return
    click.echo(f"eligible fraction per request (oracle on {len(summary.sample_ads)} ads x {len(fractions)} requests):")
    click.echo("  " + "  ".join(f"{k} {v:.2%}" for k, v in dist.items()))


@main.command(name="import")
@click.option("--ads-file", "ads_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Ads, JSON Lines (DESIGN section 2).")
@click.option("--requests-file", "requests_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Requests, JSON Lines (DESIGN section 2).")
@renamed("--ads", "--ads-file")
@renamed("--requests", "--requests-file")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="model.npz with the weights (default: seeded weights from --seed).")
@click.option("--seed", type=_SEED, default=0, show_default=True,
              help="Seed for missing embeddings, signals and default weights.")
@click.option("--precision", type=_PRECISION, default="fp32", show_default=True,
              help="How embeddings are stored.")
@click.option("--dim", type=click.IntRange(1, 4096), default=None,
              help="Embedding dimension D when no --model is given (default 64).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), callback=_output_folder,
              help="Output corpus directory.")
@click.option("--strict", is_flag=True,
              help="Write nothing and exit non-zero when any ad or request is rejected.")
@_FORCE_OPTION
@_JSON_OPTION
@_QUIET_OPTION
def import_(ads_path, requests_path, model_path, seed, precision, dim, out, strict, force, as_json, quiet):
    """Load ads and requests from JSON Lines into a corpus directory.

    Every rejected ad goes to OUT/rejected.jsonl as {"ad_id": .., "error": ".."} (the error names the
    offending field's path) and is counted on stderr; the valid ones load. Nothing is written, and the
    exit code is 1, when no ad is valid, when REQ.jsonl has lines and none is valid, or with --strict
    when any line is rejected; an OUT that holds a corpus is replaced only with --force.
    """
    import json

    from andromeda_nb.store import ImportFailed, StoreError, import_jsonl

    lines = 0
    for path in (ads_path, requests_path):
        with open(path, "rb") as fh:
            lines += sum(1 for raw in fh if raw.strip())
    try:
        with _Progress("importing", lines, quiet) as bar:
            summary = import_jsonl(ads_path, requests_path, out, model_path=model_path, seed=seed,
                                   precision=precision, strict=strict, dim=dim, progress=bar, force=force)
    except ImportFailed as exc:
        _report_rejections(exc.summary, quiet, written=False)
        raise click.ClickException(str(exc)) from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    _report_rejections(summary, quiet, written=True)
    if as_json:
        click.echo(json.dumps(summary.to_json()))
    else:
        click.echo(f"loaded {summary.ads} ads and {summary.requests} requests into {out}")


def _report_rejections(summary, quiet: bool, written: bool) -> None:
    """The count of rejected lines on stderr (even with --quiet), and the first ten of them."""
    rejected = summary.rejected_ads + summary.rejected_requests
    where = f"; see {summary.rejected_path}" if rejected and written else ""
    click.echo(f"rejected {summary.rejected_ads} ad(s) and {summary.rejected_requests} request(s){where}", err=True)
    if not quiet:
        for r in summary.rejections[:10]:
            click.echo(f"  {r['error']}", err=True)
        if rejected > 10:
            click.echo(f"  ... and {rejected - 10} more", err=True)


@main.command()
@_DATA_OPTION
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), callback=_output_folder,
              help="Directory for ads.jsonl and requests.jsonl.")
@_JSON_OPTION
@_QUIET_OPTION
def export(data, out, as_json, quiet):
    """Write a corpus directory back out as JSON Lines (DESIGN section 2): OUT/ads.jsonl and
    OUT/requests.jsonl, embeddings as the float32 values they are stored as."""
    import json

    from andromeda_nb.store import export_jsonl

    dataset = _load_dataset(data, quiet)
    ads_path, requests_path = export_jsonl(dataset, out)
    if as_json:
        click.echo(json.dumps({"ads": len(dataset.ads), "requests": len(dataset.requests), "ads_path": str(ads_path),
                               "requests_path": str(requests_path)}))
    else:
        click.echo(f"wrote {len(dataset.ads)} ads to {ads_path} and {len(dataset.requests)} requests to {requests_path}")


@main.command()
@_DATA_OPTION
@_JSON_OPTION
@_QUIET_OPTION
def reindex(data, as_json, quiet):
    """Parse and validate every ad of a corpus directory's ads.parquet again and rewrite its compiled
    targeting (targeting.npz, recorded in meta.json). For a corpus written before targeting.npz
    existed (it loads the slow way until then) or one whose ads.parquet was changed on purpose."""
    import json

    from andromeda_nb.store import StoreError, read_meta, reindex as reindex_corpus

    try:
        n_ads = int(read_meta(data)["counts"].get("ads", 0))
        with _Progress("parsing ads", n_ads, quiet) as bar:
            entry = reindex_corpus(data, progress=bar)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(entry))
    else:
        click.echo(f"compiled the targeting of {entry['ads']} ads into {data}/{entry['file']}")


# --- answers ---------------------------------------------------------------------------------------


@main.command()
@_DATA_OPTION
@click.option("--arch", type=click.Choice(["oracle", "cpu", "gpu"]), default="oracle", show_default=True,
              help="Targeting index: the plain oracle, the CPU inverted index, or the GPU index.")
@device_option("Where --arch gpu runs: the GPU, or sim (the CUDA simulator: slow, tiny corpora). auto: the GPU "
               "when usable, else it stops and says so (the GPU index has no CPU form; --arch cpu is the CPU index).")
@_UPDATES_OPTION
@_JSON_OPTION
@_QUIET_OPTION
def match(data, arch, device, updates, as_json, quiet):
    """Eligible ads per request.

    With --json, one line per request: {"request_id": .., "eligible": [ad ids ascending]}.
    """
    from andromeda_nb.answers import match_all, match_json_lines, match_table
    from migration.architectures import DEVICE_MATCHERS, ArchitectureUnavailable, build_matcher

    dataset = _load_dataset(data, quiet)
    if device != "auto" and arch not in DEVICE_MATCHERS:
        _info(f"--device {device} applies to --arch {'/'.join(DEVICE_MATCHERS)} only; ignored for {arch}", quiet)
    if arch in DEVICE_MATCHERS and device == "sim":
        from andromeda_nb.devices import simulator_note

        _info(simulator_note(dataset.n_ads, len(dataset.requests)), quiet)
    from andromeda_nb.devices import NoKernelDevice

    try:
        index = build_matcher(dataset, arch, device)
    except ArchitectureUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except NoKernelDevice as exc:
        raise click.ClickException(f"--arch {arch}: {exc}; --arch cpu is the CPU inverted index") from None
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(f"--arch {arch}: {exc}") from None
    _apply_updates(updates, [index], dataset, quiet)
    with _Progress(f"matching ({arch})", len(dataset.requests), quiet) as bar:
        eligible = match_all(index, dataset.requests, progress=bar)
    if as_json:
        for line in match_json_lines(dataset.requests, eligible):
            click.echo(line)
    else:
        click.echo(match_table(dataset.requests, eligible, len(index)))


@main.command()
@_DATA_OPTION
@click.option("--arch", type=click.Choice(["reference", "remote", "colocated", "sharded"]), default="reference",
              show_default=True, help="The float64 reference, the remote-scoring CPU design, the co-located one, "
                                      "or co-located shards with replicas on a local Ray cluster (needs the cluster "
                                      "extra).")
@device_option("Where the co-located path (and each shard of --arch sharded) runs (auto: the GPU if usable, else "
               "the CPU).")
@k_option()
@click.option("--traffic", is_flag=True,
              help="Count real bytes on the wire per request and hop through counting relays "
                   "(--arch remote or colocated); shown after the table, and per line with --json.")
@_SHARDS_OPTION
@_REPLICAS_OPTION
@_ADDRESS_OPTION
@click.option("--scorer-device", type=click.Choice(DEVICES), default=None,
              help="--arch remote: where its scoring service runs (gpu: the 2024 design, candidates shipped to "
                   "a remote GPU; auto: the GPU if usable, else the CPU) [default: the CPU scoring service].")
@_UPDATES_OPTION
@_JSON_OPTION
@_QUIET_OPTION
def retrieve(data, arch, device, k, traffic, shards, replicas, address, scorer_device, updates, as_json, quiet):
    """Top-K eligible ads per request, by score descending (ties by ad id ascending).

    With --json, one line per request: {"request_id": .., "ads": [..], "scores": [..]} in rank order.
    """
    from andromeda_nb.answers import retrieve_all, retrieve_json_lines, retrieve_table
    from migration.architectures import DEVICE_ARCHS, ArchitectureUnavailable, build_retriever

    options = {"traffic": True} if traffic else {}
    if arch == "sharded":
        _require_ray()
        if traffic:
            raise click.ClickException("--traffic needs --arch remote or colocated")
        options = {"shards": shards or 2, "replicas": replicas, "address": address,
                   "progress": lambda message: _info(message, quiet)}
    elif shards is not None or replicas != 1 or address is not None:
        _info(f"--shards, --replicas and --address apply to --arch sharded only; ignored for {arch}", quiet)
    if scorer_device is not None:
        if arch != "remote":
            _info(f"--scorer-device applies to --arch remote only; ignored for {arch}", quiet)
        else:
            options["scorer_device"] = scorer_device
    dataset = _load_dataset(data, quiet)
    if device != "auto" and arch not in DEVICE_ARCHS:
        _info(f"--device {device} applies to --arch {'/'.join(DEVICE_ARCHS)} only; ignored for {arch}", quiet)
    if traffic and arch == "reference":
        raise click.ClickException("--traffic needs --arch remote or colocated (the reference runs in this process)")
    try:
        retriever = build_retriever(dataset, arch, device, **options)
    except ArchitectureUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(f"--arch {arch}: {exc}") from None
    per_request = None
    try:
        _apply_updates(updates, [retriever], dataset, quiet)
        if traffic:
            _info(f"retrieving ({arch}), one request per exchange, counting bytes per hop", quiet)
            answers, per_request = retriever.retrieve_traffic(dataset.requests, k)
        else:
            with _Progress(f"retrieving ({arch})", len(dataset.requests), quiet) as bar:
                answers = retrieve_all(retriever, dataset.requests, k, progress=bar)
    finally:
        retriever.close()
    if as_json:
        import json

        for i, line in enumerate(retrieve_json_lines(dataset.requests, answers)):
            if per_request is not None:
                line = json.dumps({**json.loads(line), "traffic": per_request[i]})
            click.echo(line)
    else:
        click.echo(retrieve_table(dataset.requests, answers))
        if per_request:
            from serving.relay import traffic_summary

            click.echo(traffic_summary(per_request))


@main.command()
@click.option("--ads", "n_ads", type=_ADS, default=50_000, show_default=True,
              help="Ads in the built-in demo corpus.")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=12, show_default=True,
              help="Requests in the demo corpus.")
@click.option("--seed", type=_SEED, default=0, show_default=True, help="Corpus seed.")
@k_option()
@device_option("Where the co-located path runs (auto: the GPU if usable, else the CPU).")
@_JSON_OPTION
@_QUIET_OPTION
def demo(n_ads, n_requests, seed, k, device, as_json, quiet):
    """The migration, step by step, measured on this machine: find the bottleneck, the byte budget,
    one tower versus experts, co-location and its traffic, the fused kernel and int8; then both
    architectures side by side. With --json the last line is one object with every figure."""
    import json as _json

    from benchmarks.demo import DemoError, run_demo

    try:
        figures = run_demo(n_ads=n_ads, n_requests=n_requests, seed=seed, k=k, device=device,
                           echo=(lambda m: None) if as_json else click.echo,
                           log=(lambda m: None) if quiet else (lambda m: click.echo(m, err=True)))
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(_json.dumps(figures, default=float))


@main.group()
def serve():
    """Run one service in the foreground on 127.0.0.1: co-located on port 8815, the index host (remote)
    on 8816, its scoring service on 8817 (--port 0: a free one). Ask it with `andromeda query`."""


@main.group()
def bench():
    """Benchmarks (DESIGN section 7): print a table and write JSON."""

# --- remote-scoring services and CPU benchmark (cpu_baseline) ------------------------------------------


def _service_dataset(data: str, quiet: bool = False):
    from serving.services import load_dataset_for_service
    from andromeda_nb.store import StoreError

    _info(f"loading {data}", quiet)
    try:
        return load_dataset_for_service(data)
    except (StoreError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load corpus {data}: {exc}") from None


def _server_options(service: str, log: bool = True):
    """The options every `serve` command shares, as `serving.process.server_options` declares them for
    every server (address with the service's default port, tokens and TLS, limits, update log, stop
    deadline); and --quiet, which only the command reads."""
    from serving.process import server_options
    from serving.services import DEFAULT_PORTS

    def click_option(o):
        if o.kind is bool:
            return click.option(o.flag, o.dest, is_flag=True, help=o.help)
        if o.path:
            kind = click.Path(dir_okay=False)
        elif o.kind is int:
            kind = click.IntRange(o.at_least, o.at_most) if o.at_least is not None else int
        elif o.kind is float:
            kind = click.FloatRange(o.at_least, o.at_most, min_open=o.above) if o.at_least is not None else float
        else:
            kind = str
        default = DEFAULT_PORTS[service] if o.dest == "port" else o.default
        # a secret's environment variable is read by ServerSettings.from_options, after its file: a value
        # click hands over is then one typed on the command line, which _serve warns about
        return click.option(o.flag, o.dest, type=kind, default=default, envvar=None if o.secret else o.env,
                            hidden=o.hidden, show_default=default is not None, help=o.help)

    options = [click_option(o) for o in server_options(log=log) if o.cli] + [_QUIET_OPTION]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _serve(run, **options):
    """Build the settings from the options, refuse an address that cannot be used (a taken port, an
    exposed host without authentication) before anything loads, and run `run(settings)`; what the user
    must fix is a message, never a traceback."""
    from serving.process import ServerSettings, preflight, startup_errors, warn_command_line_secrets

    try:
        warn_command_line_secrets(options)
        settings = ServerSettings.from_options(**options)
        preflight(settings.host, settings.port, settings.guard)
        run(settings)
    except startup_errors() as exc:
        raise click.ClickException(str(exc)) from None


def _on_listening(service: str, settings, quiet: bool, holds):
    """When the server listens: the machine line on stdout (`announce`), and unless --quiet the banner
    on stderr; `holds(server)` says what it serves."""
    from serving.services import announce, banner

    def ready(server):
        location = settings.guard.location(settings.host, server.port)
        engine = getattr(server, "engine", None) or getattr(server, "engines", None) or getattr(server, "cluster", None)
        announce(service, location, **({"device": engine.device} if engine is not None else {}))
        if not quiet:
            click.echo(banner(service, location, holds(server)), err=True)

    return ready


def _holds(data: str, info: dict, device: str | None = None) -> str:
    """What a server holds, from its health answer: ads, precision and D, and its update log."""
    where = f", on {device}" if device else ""
    text = f"{info['ads']:,} ads of {data}"
    if "precision" in info:
        text += f" ({info['precision']}, D = {info['D']}{where})"
    log = info.get("log")
    if log is not None:
        text += (f"; {info.get('replayed', 0)} logged update(s) replayed from {log['path']}" if log.get("path")
                 else "; updates in memory only (--log off)")
    return text


_PAIR_SECRET_OPTION = click.option(
    "--pair-secret-file", type=click.Path(dir_okay=False), default=None,
    help="File holding the secret the index host signs its records to the scoring service with, or "
         "$ANDROMEDA_PAIR_SECRET [default: DIR/pair.secret beside the corpus; the scoring service makes it when "
         "absent, and only the index host's records are taken].")

_SERVE_DATA_OPTION = click.option("--data", required=True, type=click.Path(exists=True, file_okay=False),
                                  help="Corpus directory.")


@serve.command("scorer")
@_SERVE_DATA_OPTION
@device_option("Where the candidates are scored: auto (the GPU if usable, else the CPU), cpu (numba, every core: "
               "the CPU scoring service of the remote-scoring baseline), gpu (candidate ids resolved to rows and "
               "gathered on the device: the remote GPU of the 2024 design), sim (the CUDA simulator, tiny corpora).")
@click.option("--threads", type=click.IntRange(1), default=None, help="Scoring threads (default: all cores).")
@_PAIR_SECRET_OPTION
@_server_options("scorer", log=False)
def serve_scorer(data, device, threads, pair_secret_file, quiet, **options):
    """The remote scoring service: holds the ad embeddings, scores candidate lists (Arrow Flight).
    Its index host delivers every update to it from its log, and catches it up after a restart.

    Prints {"service": "scorer", "location": ...} on stdout once listening, and a banner saying how to
    use it on stderr; SIGTERM or Ctrl-C stops it."""
    from andromeda_nb.devices import resolve

    def run(settings):
        where = resolve(device)
        from migration.scorer_server import run_scorer_on

        dataset = _service_dataset(data, quiet)
        run_scorer_on(dataset, settings, device=where, threads=threads, pair_secret_file=pair_secret_file,
                      on_ready=_on_listening("scorer", settings, quiet,
                                             lambda srv: _holds(data, srv.health(), srv.device)))

    _serve(run, **options)


@serve.command("remote")
@_SERVE_DATA_OPTION
@click.option("--scorer", "scorer_address", default=None,
              help="Scoring service address (host:port; default: the scoring service's default port on 127.0.0.1).")
@click.option("--threads", type=click.IntRange(1), default=None, help="Matching threads (default: all cores).")
@click.option("--scorer-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds to wait for the scorer.")
@click.option("--scorer-token-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the token for the scoring service, or $ANDROMEDA_SCORER_TOKEN (default: the admin "
                   "token).")
@click.option("--scorer-token", default=None,
              help="That token as text: it shows in the process list; prefer $ANDROMEDA_SCORER_TOKEN or "
                   "--scorer-token-file.")
@click.option("--scorer-ca", type=click.Path(dir_okay=False), default=None, help="CA of the scorer's TLS certificate.")
@click.option("--scorer-cert", type=click.Path(dir_okay=False), default=None, help="Client certificate for the scorer.")
@click.option("--scorer-key", type=click.Path(dir_okay=False), default=None, help="Its private key.")
@_PAIR_SECRET_OPTION
@_server_options("remote")
def serve_remote(data, scorer_address, threads, scorer_timeout, scorer_token_file, scorer_token, scorer_ca,
                 scorer_cert, scorer_key, pair_secret_file, quiet, **options):
    """The index host: serves the ["retrieve"] exchange, matching on the CPU and scoring remotely (start
    `andromeda serve scorer` first). Keeps the update log (acknowledged updates survive restarts) and
    the scorer in step with it.

    Prints {"service": "remote", "location": ...} on stdout once listening, and a banner saying how to
    ask it on stderr; SIGTERM or Ctrl-C stops it."""
    from serving.services import DEFAULT_HOST, DEFAULT_PORTS
    from cpu_baseline.remote_servers import SCORER_TOKEN_WARNING, run_index_host, scorer_credentials

    if scorer_token is not None:
        click.echo(SCORER_TOKEN_WARNING, err=True)
    scorer_address = scorer_address or f"grpc://{DEFAULT_HOST}:{DEFAULT_PORTS['scorer']}"

    def run(settings):
        credentials = scorer_credentials(settings, token=scorer_token, token_file=scorer_token_file, ca=scorer_ca,
                                         cert=scorer_cert, key=scorer_key)
        _info(f"loading {data}", quiet)
        run_index_host(data, scorer_address, settings, threads=threads, scorer_timeout_s=scorer_timeout,
                       credentials=credentials, pair_secret_file=pair_secret_file,
                       on_ready=_on_listening("remote", settings, quiet, lambda srv: _holds(data, srv.health_info())
                                              + f"; scores on {scorer_address}"))

    _serve(run, **options)


@serve.command("colocated")
@_SERVE_DATA_OPTION
@device_option("Where matching and scoring run (sim: the CUDA simulator, tiny corpora only).")
@click.option("--kernel-version", "version", type=click.IntRange(1), default=None,
              help="Scoring kernel version, one of the shipped kernels (gpu/kernels/score.py VERSIONS; "
                   "default: the shipped one for the shape).")
@click.option("--batch-wait-ms", type=click.FloatRange(min=0), default=0.2, show_default=True,
              help="Longest a request waits for requests of other exchanges to share its engine batch (0: none).")
@click.option("--decode-ahead/--no-decode-ahead", default=False, show_default=True,
              help="Decode arriving requests on a thread of their own while a batch is on the engine, or "
                   "between batches on the batch's thread.")
@click.option("--switch-interval-ms", type=click.FloatRange(min=0.001), default=0.2, show_default=True,
              help="The interpreter's thread switch interval (Python's own: 5): how long a thread that lets go "
                   "of the interpreter lock (a CUDA or Arrow call) may wait to take it back.")
@click.option("--layout", type=click.Choice(LAYOUTS), default=None,
              help="The GPU engine's slot order: the corpus's, or clustered by the places the ads' geo clauses "
                   "name, so the match skips more blocks (andromeda_nb.geo_layout) [default: geo]. The CPU "
                   "engine has no slots.")
@click.option("--engines", type=click.IntRange(1), default=1, show_default=True,
              help="Engine worker processes behind one front (each loads the corpus and builds its own engine on "
                   "--device, one GPU shared; requests go to the least busy, updates to all): N interpreters for "
                   "the host work of batches instead of one. 1: the engine in the server's process.")
@click.option("--gpu-turn", is_flag=True, default=False,
              help="With --engines N: the engines take turns on the device, each gathering its next batch while "
                   "another runs, instead of sharing it by time slices.")
@click.option("--endpoints", is_flag=True, default=False,
              help="With --engines N: each engine worker also serves the retrieve exchange on a port of its own "
                   "(same host, guard and limits), listed by the server's GetFlightInfo; `andromeda query` and "
                   "serving.client follow them, so requests skip the front. Updates still go to the front.")
@click.option("--overlap-batches", is_flag=True, default=False,
              help="Prepare the next engine batch on the host (encoding, user side, staging) while the GPU answers "
                   "the one before, instead of one batch after another; no gain on the CPU engine, which runs a "
                   "batch in one piece. Not with --gpu-turn.")
@click.option("--fronts", type=click.IntRange(0), default=0, show_default=True,
              help="Front processes beside the engine workers, each serving the retrieve exchange on a port of its "
                   "own (same host, guard and limits) and listed by the server's GetFlightInfo: a front decodes its "
                   "clients' requests and sends each batch of them to an engine worker as one call, so the engines "
                   "run large batches with no per-request work in their processes (serving/lane_engine.py). "
                   "`andromeda query` and serving.client follow them; updates still go to the server. Not with "
                   "--endpoints.")
@_server_options("colocated")
def serve_colocated(data, device, version, batch_wait_ms, decode_ahead, switch_interval_ms, layout, engines, gpu_turn,
                    endpoints, overlap_batches, fronts, quiet, **options):
    """The co-located server: the ["retrieve"] exchange with match, fused scoring and top-K next to
    the ads; health, stats, update and compact actions. Acknowledged updates are in its log on disk.

    Prints {"service": "colocated", "location": ...} on stdout once listening, and a banner saying how
    to ask it on stderr; SIGTERM or Ctrl-C stops it."""
    from andromeda_nb.devices import resolve

    if gpu_turn and engines == 1:
        raise click.BadParameter("the turn is shared by several engines: give --engines 2 or more",
                                 param_hint="--gpu-turn")
    if endpoints and engines == 1:
        raise click.BadParameter("the endpoints are the engine workers' own servers: give --engines 2 or more",
                                 param_hint="--endpoints")
    if overlap_batches and gpu_turn:
        raise click.BadParameter("an engine holding the GPU's turn has no batch to overlap: give one of the two",
                                 param_hint="--overlap-batches")
    if fronts and endpoints:
        raise click.BadParameter("the fronts are the listed endpoints: give one of --fronts and --endpoints",
                                 param_hint="--fronts")

    def run(settings):
        where = resolve(device)
        from migration.colocated_server import run_colocated

        from serving.process import set_switch_interval

        set_switch_interval(switch_interval_ms)
        _info(f"loading {data}", quiet)
        run_colocated(data, settings, device=where, version=version, batch_wait_s=batch_wait_ms / 1e3,
                      decode_ahead=decode_ahead, layout=layout, say=lambda message: _info(message, quiet),
                      engines=engines, gpu_turn=gpu_turn, endpoints=endpoints, overlap=overlap_batches,
                      fronts=fronts,
                      on_ready=_on_listening("colocated", settings, quiet,
                                             lambda srv: _holds(data, srv.health_info(), srv.device)
                                             + (f"; {engines} engine worker{'s' if engines > 1 else ''}"
                                                if engines > 1 or fronts else "")
                                             + (f", each also at {', '.join(srv.retrieve_endpoints())}"
                                                if endpoints else "")
                                             + (f"; {fronts} fronts at {', '.join(srv.retrieve_endpoints())}"
                                                if fronts else "")))

    _serve(run, **options)


@main.command()
@_DATA_OPTION
@click.option("--log", "log", type=click.Path(dir_okay=False), default=None,
              help="The update log [default: DIR/updates.log].")
@_JSON_OPTION
@_QUIET_OPTION
def compact(data, log, as_json, quiet):
    """Fold a corpus's update log into a new snapshot of it, atomically, and start the log afresh.

    For a corpus no server is running on (a running server holds its log: use its compact action)."""
    import json

    from serving.compaction import compact_corpus
    from serving.process import startup_errors

    try:
        result = compact_corpus(data, log)
    except startup_errors() as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"folded {result['compacted']} updates into {data} (snapshot at update {result['seq']}, "
                   f"{result['ads']} ads); log {result['log']} starts afresh")


@main.command("truncate-log")
@click.option("--log", "log", required=True, type=click.Path(dir_okay=False),
              help="The update log a server refused as damaged (e.g. DIR/updates.log).")
@click.option("--after", type=click.IntRange(0), required=True,
              help="The last record to keep: the refusal names it (the records before the damaged one).")
@_JSON_OPTION
@_QUIET_OPTION
def truncate_log(log, after, as_json, quiet):
    """Keep a damaged update log's records up to --after and drop the rest, on purpose.

    A server never shortens a damaged log by itself: it refuses to start, naming the damaged record and
    this command. Every line up to record --after must be intact; the file as it was is kept beside the
    log (LOG.damaged). No server may hold the log meanwhile."""
    import json

    from serving.process import startup_errors
    from serving.wal import truncate_log as truncate

    try:
        result = truncate(log, after)
    except startup_errors() as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"{log}: kept the records through {after}, dropped {result['dropped_bytes']} bytes after them; "
                   f"the file as it was is {result['kept_aside']}")


def _require_ray() -> None:
    """Stop with the install command when Ray (the cluster extra) is missing."""
    from cluster import RayMissing, require_ray

    try:
        require_ray()
    except RayMissing as exc:
        raise click.ClickException(str(exc)) from None


@serve.command("cluster")
@_SERVE_DATA_OPTION
@click.option("--shards", type=click.IntRange(1, 1024), required=True,
              help="Shards the pool is split into by a hash of the ad id; each is a co-located engine.")
@_REPLICAS_OPTION
@device_option("Where every shard's engine runs (auto: the GPU if usable, else the CPU; sim is refused).",
               choices=("auto", "gpu", "cpu"))
@_ADDRESS_OPTION
@click.option("--log-dir", "log", default=None, type=click.Path(file_okay=False),
              help="Directory of the per-shard update logs, or 'off' for none (updates in memory only) "
                   "[default: DIR/cluster-log].")
@renamed("--log", "--log-dir")
@_server_options("cluster", log=False)
def serve_cluster(data, shards, replicas, device, address, quiet, log, **options):
    """Shards with replicas on Ray behind one front: the co-located server's ["retrieve"] exchange,
    health, stats and update (a client of `serve colocated` asks it unchanged). Starts a local Ray
    instance unless --address names one to join. Every update is on disk in its shard's log before it
    is acknowledged; restarted replicas catch up from the log, and a front started again on the same
    corpus replays it into its replicas before it serves (--log off: updates in memory only).

    Prints {"service": "cluster", "location": ...} on stdout once listening, and a banner saying how
    to ask it on stderr; SIGTERM or Ctrl-C stops the front, the replicas, and Ray when it started it."""
    from andromeda_nb.devices import resolve

    _require_ray()

    def run(settings):
        where = resolve(device)
        from cluster.front import run_cluster

        dataset = _service_dataset(data, quiet)
        run_cluster(dataset, settings, shards=shards, replicas=replicas, device=where, address=address,
                    data_dir=data, progress=lambda message: _info(message, quiet),
                    on_ready=_on_listening("cluster", settings, quiet,
                                           lambda srv: _holds(data, srv.health_info(), where)
                                           + f"; {shards} shard(s) x {replicas} replica(s) on Ray"))

    _serve(run, log=log, **options)


# --- the client of a running server (serving.client) ---------------------------------------------


_SERVER_OPTION = click.option("--server", "server", required=True,
                              help="The server's address, grpc://HOST:PORT (as `andromeda serve` prints it).")


def _credential_options(command):
    """What a client presents to a guarded server (`serving.guard.ClientCredentials`): a token and
    TLS material; a server on loopback without tokens needs none."""
    options = [
        click.option("--token", envvar="ANDROMEDA_TOKEN", default=None,
                     help="Token the server asks for: a reader token ($ANDROMEDA_TOKEN)."),
        click.option("--tls-ca", type=click.Path(dir_okay=False), default=None,
                     help="CA of the server's TLS certificate (PEM); the address becomes grpc+tls://."),
        click.option("--tls-cert", type=click.Path(dir_okay=False), default=None,
                     help="Client certificate (PEM), for a server that asks for mutual TLS."),
        click.option("--tls-key", type=click.Path(dir_okay=False), default=None, help="Its private key (PEM)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _credentials(token, tls_ca, tls_cert, tls_key):
    from serving.guard import ClientCredentials, GuardError

    try:
        return ClientCredentials.from_files(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    except GuardError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@_SERVER_OPTION
@click.option("--requests-file", "requests_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Requests to send: JSON Lines (DESIGN section 2).")
@click.option("--data", "data", type=click.Path(exists=True, file_okay=False), default=None,
              help="Or a corpus directory (made by `generate` or `import`): send its requests.")
@renamed("--requests", "--requests-file", now="--requests-file (a JSON Lines file) or --data (a corpus directory)",
         pick=lambda value: "--data" if os.path.isdir(value) else "--requests-file")
@k_option()
@click.option("--follow-endpoints/--no-follow-endpoints", default=True, show_default=True,
              help="Where the server lists other locations of its retrieve exchange (serve colocated --endpoints: "
                   "its engine workers' own), ask one of them instead, and the server once it is gone.")
@_credential_options
@_JSON_OPTION
@_QUIET_OPTION
def query(server, requests_file, data, k, follow_endpoints, token, tls_ca, tls_cert, tls_key, as_json, quiet):
    """Top-K eligible ads per request from a running server of either architecture (`andromeda serve
    colocated` or `remote`), printed as `retrieve` prints them: a table, or with --json one line per
    request {"request_id": .., "ads": [..], "scores": [..]}.

    A request the server refuses is reported on stderr with its reason and the others are answered;
    the exit code is 1 when no request was answered."""
    import pyarrow.flight as flight

    from andromeda_nb.answers import retrieve_json_lines, retrieve_table
    from serving.client import ServerUnreachable, query as ask, read_requests

    if (requests_file is None) == (data is None):
        raise click.UsageError("give the requests to send: --requests-file FILE or --data DIR, one of them")
    requests_path = requests_file or data
    try:
        requests, unreadable = read_requests(requests_path)
        _info(f"asking {server} for the top {k} of {len(requests)} request(s)", quiet)
        result = ask(server, requests, k, credentials=_credentials(token, tls_ca, tls_cert, tls_key),
                     follow_endpoints=follow_endpoints)
    except (ValueError, ServerUnreachable) as exc:
        raise click.ClickException(str(exc)) from None
    except flight.FlightError as exc:  # refused as a whole: no token, a wrong one, a limit
        raise click.ClickException(f"{server} refused: {str(exc).splitlines()[0]}") from None
    for reason in unreadable + result.rejected:  # reported even with --quiet
        click.echo(f"  rejected request {reason}", err=True)
    if as_json:
        for line in retrieve_json_lines(result.request_ids, result.answers):
            click.echo(line)
    elif result.answers:
        click.echo(retrieve_table(result.request_ids, result.answers))
    if not result.answers:
        raise click.ClickException(f"no request of {requests_path} was answered "
                                   f"({len(unreadable) + len(result.rejected)} rejected)")


@main.command()
@_SERVER_OPTION
@_credential_options
@_JSON_OPTION
@_QUIET_OPTION
def health(server, token, tls_ca, tls_cert, tls_key, as_json, quiet):
    """Ask a running server (any of `andromeda serve`) how it is: its `health` answer, as lines of
    "key: value" (nested fields as dotted keys, e.g. log.path), or one JSON line with --json. Exits 1
    when no server answers."""
    import json

    import pyarrow.flight as flight

    from serving.client import ServerUnreachable, health as ask, health_lines

    try:
        answer = ask(server, credentials=_credentials(token, tls_ca, tls_cert, tls_key))
    except ServerUnreachable as exc:
        raise click.ClickException(str(exc)) from None
    except flight.FlightError as exc:
        raise click.ClickException(f"{server} refused: {str(exc).splitlines()[0]}") from None
    if as_json:
        click.echo(json.dumps(answer))
    else:
        click.echo("\n".join(health_lines(answer)))


@bench.command("cpu")
@click.option("--ads", "n_ads", type=_ADS, default=200_000, show_default=True, help="Pool size (ads).")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=64, show_default=True,
              help="Requests for match and end-to-end.")
@k_option("Top-K of the end-to-end runs.")
@click.option("--seed", type=_SEED, default=1, show_default=True, help="Corpus seed.")
@click.option("--precision", "precisions", multiple=True, default=PRECISIONS, show_default=True,
              type=_PRECISION, help="Storage precisions to score.")
@click.option("--e2e-precision", default="int8", show_default=True, type=_PRECISION,
              help="Storage precision of the end-to-end run.")
@click.option("--score-rows", type=click.IntRange(1), default=2_000_000, show_default=True,
              help="Rows of the scorer's table (sized well past the last-level cache).")
@click.option("--repeat", type=click.IntRange(1), default=5, show_default=True,
              help="Repetitions per timing (median reported).")
@_OUT_JSON_OPTION
@_BENCH_JSON_OPTION
@_QUIET_OPTION
def bench_cpu(n_ads, n_requests, k, seed, precisions, e2e_precision, score_rows, repeat, out, as_json, quiet):
    """Remote-scoring baseline: CPU match (pool ads/s), CPU scorer (ads/s, GB/s against this machine's
    measured copy bandwidth) and end-to-end requests/s with p50/p99 latency over Flight."""
    from benchmarks.cpu import format_table, run_cpu_bench

    result = run_cpu_bench(n_ads=n_ads, n_requests=n_requests, k=k, seed=seed, precisions=precisions,
                           e2e_precision=e2e_precision, repeat=repeat, score_rows=score_rows,
                           log=lambda message: _info(message, quiet))
    from andromeda_nb.measure import json_line

    _stamp(result, "cpu")
    click.echo(json_line(result) if as_json else format_table(result))
    _write_json(result, out, quiet)


@bench.command("match")
@int_list_option("--ads", default="10000000,100000000",
                 help="Pool sizes in ads, comma-separated, each timed; each pool tiles the generated base corpus.")
@int_list_option("--kernel-versions", "versions",
                 help="Match kernel versions to time, comma-separated (default: all that run here).")
@int_list_option("--batches", default="64,256", help="Requests per launch, comma-separated.")
@click.option("--base-ads", type=click.IntRange(1), default=32_768, show_default=True,
              help="Ads of the generated base corpus.")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=256, show_default=True,
              help="Requests generated.")
@click.option("--seed", type=_SEED, default=7, show_default=True, help="Corpus seed.")
@click.option("--base", "base_path", type=click.Path(dir_okay=False), default=None,
              help="Base corpus cache (Parquet): read when present, else generated and written there.")
@click.option("--measure-updates/--no-measure-updates", "updates", default=True, show_default=True,
              help="Measure updates per second applied while serving (on the first pool).")
@click.option("--cpu-ads", "cpu_pool", type=click.IntRange(0), default=1_000_000, show_default=True,
              help="Pool size in ads of the CPU inverted index timed beside the GPU figures (0: skip it).")
@click.option("--layout", type=click.Choice(LAYOUTS), default="format", show_default=True,
              help="Slot order within a format: the base corpus's copy after copy ('format'), or clustered by the "
                   "places the ads' geo clauses name ('geo', as bench pipeline and the engine lay it out).")
@device_option("Where the kernels run (sim: the CUDA simulator; tiny pools only).", choices=("auto", "gpu", "sim"))
@_OUT_JSON_OPTION
@_BENCH_JSON_OPTION
@_QUIET_OPTION
@renamed("--pools", "--ads")
@renamed("--versions", "--kernel-versions")
@renamed("--updates", "--measure-updates")
@renamed("--no-updates", "--no-measure-updates")
@renamed("--cpu-pool", "--cpu-ads")
def bench_match(ads, versions, batches, base_ads, n_requests, seed, base_path, updates, cpu_pool, layout, device,
                out, as_json, quiet):
    """GPU targeting index: pool ads/s of every match kernel version for each pool size, device bytes
    per ad, updates/s applied while serving, and the CPU index beside it; the full-size answer is
    checked against the oracle before anything is timed, and the output of every timed launch after."""
    from andromeda_nb.measure import json_line

    from benchmarks.match_both import bench_match as run_bench

    try:
        from benchmarks import match as bm

        result = run_bench(pools=ads, versions=versions, batches=batches, base_ads=base_ads, requests=n_requests,
                           seed=seed, base_path=base_path,
                           updates=(bm.UPDATE_ROUNDS, bm.UPDATES_PER_ROUND) if updates else None,
                           cpu_pool=cpu_pool, layout=layout, device=device, progress=not quiet, out=out)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise click.ClickException(f"bench match: {exc}") from None
    _stamp(result, "match")
    click.echo(json_line(result) if as_json else bm.table(result))
    # rewritten with the command and environment (the partial files written during the run lack them)
    _write_json(result, out, quiet)


@bench.command("score")
@click.option("--ads", "n_ads", type=_ADS, default=1 << 26, show_default=True,
              help="Pool size (ads), generated on the GPU.")
@int_list_option("--dims", default="64,128", help="Embedding dims, comma-separated.")
@click.option("--precision", "precisions", multiple=True, default=PRECISIONS, show_default=True,
              type=_PRECISION, help="Storage precisions.")
@int_list_option("--kernel-versions", "versions",
                 help="Scoring kernel versions to time, comma-separated (default: all).")
@k_option("Top-K of the full-size check and the timed runs.")
@click.option("--unfused/--no-unfused", default=True, show_default=True, help="Also time the unfused CuPy pipeline.")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also time the PyTorch peers (dot, eager and compiled MoE) where PyTorch is importable.")
@click.option("--eligible", "eligible", type=ShareList(), default="1", show_default=True,
              help="Shares of the pool eligible, comma-separated: 1 (the targets' condition) and, for example, "
                   "0.08 (a random 8%, as a request's match leaves it) to time the walk over eligible ads.")
@click.option("--seed", type=_SEED, default=0, show_default=True, help="Seed of the pool and the model.")
@_OUT_JSON_OPTION
@_BENCH_JSON_OPTION
@_QUIET_OPTION
@renamed("--versions", "--kernel-versions")
def bench_score(n_ads, dims, precisions, versions, k, unfused, peers, eligible, seed, out, as_json, quiet):
    """Fused scoring kernel: ads/s and fraction of the copy bandwidth (measured in the same run) for
    every version x {moe, dot} x precision x D, each checked against the float64 reference first;
    the unfused CuPy pipeline beside it. Needs a CUDA GPU and CuPy."""
    from andromeda_nb.measure import json_line

    try:
        from benchmarks import score as bs

        result = bs.bench_score(n_ads=n_ads, dims=dims, precisions=precisions, versions=versions, k=k, seed=seed,
                                unfused=unfused, peers=peers, eligible=eligible, progress=not quiet, out=out)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise click.ClickException(f"bench score: {exc}") from None
    _stamp(result, "score")
    click.echo(json_line(result) if as_json else bs.score_table(result))
    _write_json(result, out, quiet)


@bench.command("pipeline")
@click.option("--data", "data", type=click.Path(exists=True, file_okay=False), default=None,
              help="A corpus directory (generate, import): its distinct ads and its own requests, as serve "
                   "colocated serves them, in place of the tiled pool (--ads, --base-ads, --precision, --dim and "
                   "--seed then come from the corpus).")
@click.option("--ads", "pool", type=_ADS, default=10_000_000, show_default=True,
              help="Pool size in ads: a generated base corpus, tiled.")
@click.option("--copies", type=click.IntRange(1), default=None,
              help="With --data: the pool is this many distinct copies of the corpus, made in memory (pools "
                   "larger than a run can generate): copy 0 is the corpus; each other copy of an ad has its own "
                   "id, places, audiences, circles, schedule and embedding (benchmarks/copies.py). The host "
                   "memory it takes is printed on stderr first.")
@click.option("--check-requests", type=click.IntRange(1), default=None,
              help="Check every timed answer of this many distinct requests, evenly spaced (default: every "
                   "request of the tiled pool; 32 of a --data corpus, whose eligible sets take the CPU index "
                   "about a tenth of a second each at 10M ads).")
@click.option("--base-ads", type=click.IntRange(1), default=8192, show_default=True,
              help="Ads of the generated base corpus.")
@click.option("--precision", default="fp16", show_default=True, type=_PRECISION,
              help="Stored embedding precision of the pool.")
@click.option("--dim", type=click.IntRange(1, 4096), default=64, show_default=True, help="Embedding dim.")
@k_option("Top-K per request.")
@int_list_option("--batches", default="1,16,64", help="Requests per batch for throughput.")
@click.option("--kernel-version", "score_version", type=click.IntRange(1), default=None,
              help="Scoring kernel version of the kernel lab (default: the shipped one for the shape).")
@click.option("--match-version", "match_version", type=click.IntRange(1), default=None,
              help="Match kernel version of the kernel lab (gpu/lab/match.py; default: the shipped one).")
@click.option("--seed", type=_SEED, default=0, show_default=True, help="Corpus seed.")
@click.option("--layouts", "layouts", default=DEFAULT_LAYOUT, show_default=True, metavar="LIST",
              callback=lambda c, p, v: _layout_list(v),
              help="Slot order within a format: the base corpus's copy after copy ('format'), or clustered by the "
                   "places the ads' geo clauses name over the whole pool ('geo', andromeda_nb.geo_layout). "
                   "Comma-separated: each in turn in one run, the first as the result and the others beside it.")
@click.option("--launches", "launches", default=",".join(LAUNCHES), show_default=True, metavar="LIST",
              callback=lambda c, p, v: _word_list(v, LAUNCHES),
              help="How a batch's upload, kernels and answer copies are enqueued: replayed from a CUDA graph "
                   "('graph', as the engine serves) or step by step ('direct'). Comma-separated: each measured on "
                   "the same pool in one run, the first reported as the result.")
@device_option("Where the kernels run (sim: the CUDA simulator; tiny pools only, its figures a simulation's).",
               choices=("auto", "gpu", "sim"))
@_OUT_JSON_OPTION
@_BENCH_JSON_OPTION
@_QUIET_OPTION
@renamed("--pool", "--ads")
@renamed("--score-version", "--kernel-version")
@renamed("--layout", "--layouts")
@renamed("--launch", "--launches")
def bench_pipeline(data, pool, copies, check_requests, base_ads, precision, dim, k, batches, score_version,
                   match_version, seed, layouts, launches, device, out, as_json, quiet):
    """Co-located pipeline end to end (user side, GPU match, fused scoring, top-K, answers back):
    per-request p50/p99 latency and pool ads/s, on a generated pool tiled to --ads, on a corpus of
    distinct ads (--data), or on distinct copies of one (--data DIR --copies N). Every timed answer is
    checked against the float64 reference over the eligible sets (the oracle's over the tiled pool;
    over a corpus or its copies, the CPU index's, held to the oracle on a sample), every timed match
    row against them; a target is met only when every check passed."""
    from andromeda_nb.measure import json_line

    if copies is not None and data is None:
        raise click.UsageError("--copies: copies of what? Give the corpus with --data DIR")
    if data is not None:
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in ("pool", "base_ads", "precision", "dim", "seed")
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given).replace('--pool', '--ads')}: the corpus of --data decides "
                                   "these; leave them out")
    try:
        from benchmarks import score as bs

        result = bs.bench_pipeline_layouts(layouts, pool=pool, base_ads=base_ads, precision=precision, dim=dim, k=k,
                                           batches=batches, score_version=score_version,
                                           match_version=match_version, seed=seed,
                                           launches=launches, device=device, data=data, copies=copies,
                                           check_requests=check_requests, progress=not quiet)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise click.ClickException(f"bench pipeline: {exc}") from None
    _stamp(result, "pipeline")
    click.echo(json_line(result) if as_json else "\n\n".join(
        f"layout {r['layout']}:\n{bs.pipeline_table(r)}" for r in [result, *result.get("other_layouts", {}).values()]))
    _write_json(result, out, quiet)


@bench.command("served")
@click.option("--data", required=True, type=click.Path(exists=True, file_okay=False),
              help="Corpus directory (made by `andromeda generate` or `import`).")
@device_option("Where the engine runs, in process and in the server.", choices=("auto", "gpu", "cpu"))
@k_option()
@click.option("--layout", type=click.Choice(["format", "geo"]), default=None,
              help="The GPU engine's slot order, in process and served alike [default: the engine's].")
@click.option("--clients", type=click.IntRange(1), default=32, show_default=True,
              help="Plain Flight clients, each with one request in flight.")
@click.option("--client-processes", type=click.IntRange(1), default=4, show_default=True,
              help="Processes the clients are spread over.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="How long the clients send, for each way of serving.")
@click.option("--exchange", type=click.Choice(["call", "stream"]), multiple=True, default=("stream",),
              show_default=True, help="An exchange per request (call) or one per client (stream); repeat for both.")
@click.option("--request-format", type=click.Choice(["json", "columns"]), multiple=True, default=("json",),
              show_default=True, help="The clients' request batches; repeat for both.")
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True,
              help="Requests per in-process batch (the rate the target compares with).")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True, help="In-process passes.")
@click.option("--checks", type=click.IntRange(1), default=16, show_default=True,
              help="In-process answers checked against the float64 reference before timing.")
@int_list_option("--engines", default="1",
                 help="Engine processes behind the server's front (serve colocated --engines), each count against "
                      "a fresh server: 1,2,4 compares them in one run.")
@click.option("--via", "vias", type=click.Choice(["front", "workers"]), multiple=True, default=("front",),
              show_default=True,
              help="What the clients reach with --engines N (N > 1): the server's front, or the engine workers' own "
                   "endpoints (serve colocated --endpoints), which the clients follow; repeat for both.")
@click.option("--overlap", "overlaps", type=click.Choice(["off", "on"]), multiple=True, default=("off",),
              show_default=True,
              help="on: the server's engines prepare each batch on the host while the GPU answers the one before "
                   "(serve colocated --overlap-batches); repeat for both, each against a fresh server.")
@click.option("--fronts", type=CountList(), default="0", show_default=True,
              help="Front processes beside the server's engines (serve colocated --fronts), which the clients "
                   "follow, each count against a fresh server: 0,4 compares them in one run.")
@click.option("--cluster", "clusters", multiple=True, metavar="SxR",
              help="Also `serve cluster` (Ray) with S shards of R replicas each, e.g. 1x4 (R replicas sharing one "
                   "GPU), each against a fresh server; repeat for several. Needs the cluster extra.")
@_OUT_FILE
@_BENCH_JSON_OPTION
@_QUIET_OPTION
def bench_served(data, device, k, layout, clients, client_processes, seconds, exchange, request_format, batch,
                 repeat, checks, engines, vias, overlaps, fronts, clusters, out, as_json, quiet):
    """The served path against the engine in process: `serve colocated` started on loopback, many plain
    Flight clients each with one request in flight, requests per second and latency against the
    in-process rate in batches of --batch (target: 70%). The in-process answers are checked against the
    float64 reference first, and every served answer of the first pass against the in-process one; the
    target counts only with both checks passed. `python -m benchmarks.served` takes the probes' options
    (CPU pinning, py-spy, decoding ahead, switch intervals)."""
    from andromeda_nb.measure import json_line

    from benchmarks import served

    try:
        pairs = served.cluster_specs(",".join(clusters))
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("--cluster "), param_hint="--cluster") from None
    if "workers" in vias and max(engines) < 2:
        raise click.BadParameter("the clients reach the engine workers only where there are several: give "
                                 "--engines 2 or more", param_hint="--via")
    if pairs:
        _require_ray()
    try:
        result = served.run(data, device=device, k=k, layout=layout, batch=batch, repeat=repeat, clients=clients,
                            client_processes=client_processes, seconds=seconds, exchanges=exchange,
                            request_formats=request_format, engines=engines, vias=vias,
                            overlaps=[o == "on" for o in dict.fromkeys(overlaps)], clusters=pairs,
                            checks=checks, progress=lambda m: _info(m, quiet), fronts=fronts)
    except (RuntimeError, ValueError, OSError) as exc:
        raise click.ClickException(f"bench served: {exc}") from None
    _stamp(result, None)
    click.echo(json_line(result) if as_json else served.table(result))
    _write_json(result, out, quiet)
    if not result["checks_ok"]:
        raise click.ClickException("bench served: answers differ from the reference (see reference_check and "
                                   "n_wrong); no figure of this run counts")


@bench.command("cluster")
@click.option("--data", type=click.Path(exists=True, file_okay=False), default=None,
              help="Corpus directory whose pool is split into the shards (or --tiled).")
@click.option("--tiled", type=click.IntRange(1), default=None, metavar="COPIES",
              help="Instead of --data: every shard holds its own tiled pool on the GPU, COPIES copies of a generated "
                   "base corpus (12,208 copies of 8,192 ads: 100M ads a shard), so the pool grows with the shards.")
@click.option("--base-ads", type=click.IntRange(1), default=8192, show_default=True,
              help="--tiled: ads of the generated base corpus.")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=64, show_default=True,
              help="--tiled: requests of the generated base corpus.")
@click.option("--dim", type=click.IntRange(1, 4096), default=64, show_default=True, help="--tiled: embedding dim.")
@click.option("--seed", type=_SEED, default=0, show_default=True,
              help="--tiled: the base corpus's and the model's seed.")
@int_list_option("--shards", default="1,2,4", help="Shard counts to time.")
@int_list_option("--batches", default="1,64", help="Requests per batch.")
@k_option()
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Passes over the requests per timing.")
@device_option("Where the engine and every shard run (sim: --tiled only, tiny pools).")
@click.option("--placement", type=click.Choice(["processes", "ray"]), default="processes", show_default=True,
              help="Shards as plain processes (Flight fan-out; one per GPU where there are several), or as Ray "
                   "actors (actor calls and Flight; needs the cluster extra). --tiled: processes.")
@click.option("--gpus", type=click.IntRange(1), default=None,
              help="Shard processes on the GPU go round the first N GPUs this process may use (default: all).")
@_OUT_JSON_OPTION
@_BENCH_JSON_OPTION
@_QUIET_OPTION
def bench_cluster(data, tiled, base_ads, n_requests, dim, seed, shards, batches, k, repeat, device, placement, gpus,
                  out, as_json, quiet):
    """Shards behind a router against one engine: microseconds per request by shard count and batch
    size, each Flight row split into encoding, fan-out (slowest shard) and merge, pool ads/s and the
    scaling efficiency against one shard. Every path's answers are checked first: against one
    in-process engine (--data), or against each shard's float64 reference and the merge of the
    shards' own answers (--tiled)."""
    from andromeda_nb.measure import json_line
    from andromeda_nb.devices import resolve

    from benchmarks import cluster as cb

    where = resolve(device)
    problem = cb.options_problem(data, tiled, where)
    if problem:
        raise click.UsageError(problem)
    say = lambda message: _info(message, quiet)  # noqa: E731
    try:
        if tiled is not None:
            from benchmarks.tiled import TiledPool

            pool = TiledPool(base_ads, tiled, seed=seed, dim=dim, n_requests=n_requests)
            result = cb.measure_tiled(pool, shards, k=k, repeat=repeat, batches=batches, device=where, gpus=gpus,
                                      say=say)
        else:
            if placement == "ray":
                _require_ray()
            result = cb.measure(_load_dataset(data, quiet), shards, k=k, repeat=repeat, batches=batches, device=where,
                                placement=placement, data_dir=data, gpus=gpus, say=say)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise click.ClickException(f"bench cluster: {exc}") from None
    _stamp(result, None)  # its own kind: cluster_data_path or cluster_tiled_scaling
    click.echo(json_line(result) if as_json else cb.table(result))
    _write_json(result, out, quiet)


@bench.command("report")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out", default="docs", show_default=True, type=click.Path(file_okay=False),
              callback=_output_folder,
              help="Directory of BENCHMARKS.md; the charts go to OUT/benchmarks/.")
@click.option("--charts/--no-charts", default=True, show_default=True,
              help="Draw the PNG charts (needs matplotlib, the `plots` extra; skipped with a note without it).")
@click.option("--command", "commands", multiple=True, metavar="FILE=COMMAND",
              help="The command that made FILE, for JSON that does not record it (repeatable).")
@_JSON_OPTION
@_QUIET_OPTION
def bench_report(files, out, charts, commands, as_json, quiet):
    """Turn benchmark JSON into OUT/BENCHMARKS.md with PNG charts: a roofline of the kernels against
    the copy bandwidth measured in the same run, match throughput against pool size (GPU and CPU
    index), pipeline throughput and latency, bytes on the wire, and the CPU baseline figures.

    FILES are the JSON written by `bench match|score|pipeline|cpu --out-file`, `compare --json` and
    `quality --out` (a directory stands for its *.json files); each file's kind is recognised from
    its content. Only the generated part of BENCHMARKS.md (between its markers) is rewritten."""
    import json

    from benchmarks.report import ReportError, build_report, format_summary, parse_commands

    try:
        result = build_report(files, out, charts=charts, commands=parse_commands(commands))
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    if result.skipped and charts:
        _info(f"charts skipped: {result.skipped}", quiet)
    click.echo(json.dumps(result.to_json()) if as_json else format_summary(result))


# --- retrieval quality (andromeda_nb.quality) ----------------------------------------------------------


@main.command()
@click.option("--seed", type=_SEED, default=0, show_default=True,
              help="Seed of the synthetic world, the logs and the training.")
@click.option("--out", type=click.Path(file_okay=False), default=None, callback=_output_folder,
              help="Write model.npz (MoE k=2 with the two-tower weights), model_k1/_k4/_dense.npz, "
                   "quality.json and quality.png (with the `plots` extra) into this directory.")
@click.option("--small", is_flag=True, help="A small world and short training: seconds, for a first look.")
@click.option("--precision", type=_PRECISION, default="fp32", show_default=True,
              help="Stored embedding precision the trained models are evaluated on.")
@click.option("--kernel/--no-kernel", default=True, show_default=True,
              help="Measure the fused kernel's ads/s for each model when a CUDA GPU is usable.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON Lines on stdout: the result as one line (recall, flops_per_ad, bytes_per_ad, ...), "
                   "instead of the table.")
@_QUIET_OPTION
def quality(seed, out, small, precision, kernel, as_json, quiet):
    """Retrieval quality on synthetic data with known truth: train the two-tower baseline and the
    mixture of user experts (k = 1, 2, 4 of 6, and dense) on logged clicks, and report recall@100
    against the ranking model's top 100 among eligible ads, with FLOPs and bytes per ad."""
    import dataclasses

    from andromeda_nb.quality import QualityConfig, run_quality
    from andromeda_nb.quality.report import format_table, summary_line, write_outputs

    try:
        config = QualityConfig.small(seed) if small else QualityConfig(seed=seed)
        config = dataclasses.replace(config, precision=precision)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    result = run_quality(config, progress=None if quiet else (lambda m: click.echo(m, err=True)))
    if kernel:
        from migration.quality_kernel import measure_result

        result.kernel = measure_result(result)
        _info(f"kernel: {result.kernel.get('skipped') or result.kernel.get('device')}", quiet)
    if out:
        for what, where in write_outputs(result, out, extra=_stamp({}, "quality")).items():
            _info(f"{what}: {where}", quiet)
    if as_json:
        import json

        click.echo(json.dumps({**json.loads(summary_line(result)), **_stamp({}, "quality")}))
    else:
        click.echo(format_table(result))


# --- the side-by-side harness ----------------------------------------------------------------------


@main.command()
@_DATA_OPTION
@k_option()
@device_option("Where the co-located path and the GPU index run. auto: the GPU when usable, else the co-located "
               "path on the CPU and the GPU index skipped (it has no CPU form); sim: both under the CUDA simulator "
               "(tiny corpora).")
@_UPDATES_OPTION
@click.option("--requests", "n_requests", type=click.IntRange(1), default=None,
              help="Requests to use: the first N of the corpus [default: all].")
@click.option("--oracle-requests", type=click.IntRange(0), default=None,
              help="Check only the first N requests against the plain-Python oracle (default: every request, "
                   "one process per core); the reference then takes the rest's eligible sets from the CPU index.")
@click.option("--traffic-requests", type=click.IntRange(1), default=16, show_default=True,
              help="Requests sent one at a time through the counting relays to measure bytes on the wire.")
@click.option("--runs", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Timed runs of all requests per architecture (the median is reported, and the range).")
@click.option("--link-latency-us", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="One-way latency each network hop adds, in microseconds (e.g. 100: a data-center network).")
@click.option("--link-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Bandwidth cap of each network hop in Gb/s (e.g. 25) [default: loopback, uncapped].")
@click.option("--scorer-devices", type=_device_list, default="cpu,auto", show_default=True, metavar="LIST",
              help="The remote design's scoring service, once per device in this list (auto: the GPU when usable, "
                   "else the CPU; the same device twice runs once): e.g. cpu,gpu for the three-way table.")
@click.option("--layout", type=click.Choice(LAYOUTS), default=None,
              help="Slot order of the GPU index and the GPU co-located engine: the corpus's, or clustered by the "
                   "places the ads' geo clauses name [default: geo on a GPU or the simulator]; the CPU engine "
                   "has none.")
@_JSON_OPTION
@_QUIET_OPTION
def compare(data, k, device, updates, n_requests, oracle_requests, traffic_requests, runs, scorer_devices,
            link_latency_us, link_gbps, layout, as_json, quiet):
    """Both architectures side by side on the same requests and update stream: eligible-set, score
    and top-K agreement (DESIGN section 4), bytes on the wire per request and hop, requests per
    second. The remote design runs once per scorer device (by default its CPU scoring service and,
    where a GPU is usable, a scoring service on the GPU), so the table separates what the GPU buys
    from what co-location buys. With --json the last line is one object (eligible_equal, topk_equal,
    bytes_per_request, traffic_reduction, architectures, ...). Exits non-zero when they disagree."""
    import json as _json
    import time

    from migration.harness import format_report, run_comparison

    started = time.monotonic()
    dataset = _load_dataset(data, quiet)
    try:  # progress lines carry the time since the start: at 10M ads a step takes minutes
        report = run_comparison(dataset, k=k, device=device, updates_path=updates, requests=n_requests,
                                oracle_requests=oracle_requests, traffic_requests=traffic_requests, runs=runs,
                                scorer_devices=scorer_devices, link=_link(link_latency_us, link_gbps), layout=layout,
                                log=lambda m: _info(f"[{time.monotonic() - started:7.1f} s] {m}", quiet))
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    _stamp(report, "compare")
    click.echo(_json.dumps(report) if as_json else format_report(report))
    if not (report["eligible_equal"] and report["scores_equal"] and report["topk_equal"]):
        raise SystemExit(1)


@main.command()
@click.option("--data", "data", default=None, type=click.Path(exists=True, file_okay=False),
              help="Corpus directory: network bytes from its real requests and eligible-set sizes.")
@k_option()
@click.option("--dim", type=click.IntRange(1, 4096), default=None,
              help="Embedding dimension (default: the corpus's, or 64).")
@click.option("--measured", "measured", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="Benchmark or compare JSON whose measured figures are printed beside the budget (repeatable).")
@_JSON_OPTION
@_QUIET_OPTION
def budget(data, k, dim, measured, as_json, quiet):
    """The byte budget per candidate: device-memory bytes read and written per ad for the fused and
    the unfused path at each precision, and network payload bytes per request for each
    architecture, counted from the data layout and printed beside measured values."""
    import json as _json

    from migration.budget import build_budget, format_budget

    dataset = _load_dataset(data, quiet) if data else None
    try:
        report = build_budget(dataset, k=k, dim=dim, measured=list(measured))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(_json.dumps(report) if as_json else format_budget(report))


if __name__ == "__main__":
    main()
