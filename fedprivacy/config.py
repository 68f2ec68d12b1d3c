"""Typed, validated run configuration: the single source of truth for a run.

A YAML file (see ``configs/``) is parsed into :class:`RunConfig`; ``--set key=value`` overrides
address nested fields with dots (``privacy.noise_multiplier=0``). Unknown fields are errors, and
every error names the offending field, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedprivacy.privacy.bounds import (MAX_NOISE_MULTIPLIER, MAX_NOISE_STD, MIN_DELTA, MIN_NOISE_MULTIPLIER,
                                       check_noise_std)


M = TypeVar("M", bound=BaseModel)

DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?|mps")
"""The values ``device`` takes (:class:`RunConfig`)."""


def _accountable(z: float) -> float:
    """A noise multiplier the accountants compute (:mod:`fedprivacy.privacy.bounds`)."""
    if not (z == 0.0 or MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER):
        raise ValueError(f"must be 0 (no privacy) or in [{MIN_NOISE_MULTIPLIER}, {MAX_NOISE_MULTIPLIER:g}] "
                         f"(what the accountants compute), got {z}")
    return z


NoiseMultiplier = Annotated[float, Field(ge=0.0, le=MAX_NOISE_STD), AfterValidator(_accountable)]
"""z = noise std / clip norm: 0, or within what the accountants compute."""
Delta = Annotated[float, Field(ge=MIN_DELTA, lt=1.0)]
"""A delta within what the accountants compute."""
PluginSpec = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
"""``package.module:factory``: a plug-in a run imports and calls (:func:`plugins`)."""


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no field takes inf or NaN


TFDS_NAME = re.compile(r"[a-z][a-z0-9_]*(/[A-Za-z0-9_.\-]+)?(:[0-9]+\.[0-9]+\.[0-9]+)?")
"""A TFDS dataset name as ``tfds.builder`` takes it: ``name``, ``name/config``, either with ``:x.y.z``."""
TFDS_SPLIT = re.compile(r"[A-Za-z0-9_\-]+(\[[-0-9:%a-z_()]*\])?(\+[A-Za-z0-9_\-]+(\[[-0-9:%a-z_()]*\])?)*")
"""A TFDS split expression: names, optional slices (``train[:80%]``), joined with ``+``."""
TFDS_FEATURE = re.compile(r"[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*")
"""A feature of a TFDS dataset; ``/`` descends into a nested ``FeaturesDict``."""


def _tfds_name(value: str) -> str:
    if not TFDS_NAME.fullmatch(value):
        raise ValueError("must be a TFDS dataset name: name, name/config or either with :x.y.z (e.g. mnist:3.0.1)")
    return value


def _tfds_split(value: str) -> str:
    if not TFDS_SPLIT.fullmatch(value):
        raise ValueError("must be a TFDS split such as train, test[:50%] or train[:10%]+validation")
    return value


def _tfds_feature(value: str) -> str:
    if not TFDS_FEATURE.fullmatch(value):
        raise ValueError("must be a feature name (a/b for a nested feature), letters, digits, _ and -")
    return value


TFDSSplit = Annotated[str, AfterValidator(_tfds_split)]
TFDSFeature = Annotated[str, AfterValidator(_tfds_feature)]


class TFDSConfig(_Section):
    """A TensorFlow Datasets dataset already prepared in ``data_dir`` (never downloaded; :mod:`fedprivacy.tfds_task`).

    Federated: one client per distinct value of ``client_feature`` in ``train_split``; evaluation on
    ``test_split``; ``public_split`` (records disjoint from ``train_split``) is the public pool of AdaDPS's
    side information and of centralized pre-training. Inputs: fixed-shape numeric ``Tensor`` features,
    flattened and concatenated, times ``input_scale``; label: a scalar integer feature in ``[0, num_classes)``.
    """

    name: Annotated[str, AfterValidator(_tfds_name)]
    """Dataset name as ``tfds.builder`` takes it (``mnist``, ``my_data/config``, ``mnist:3.0.1``)."""
    data_dir: Path
    """The TFDS data folder holding ``<name>/[<config>/]<version>/`` (what ``tfds build --data_dir`` wrote)."""
    train_split: TFDSSplit = "train"
    test_split: TFDSSplit = "test"
    public_split: TFDSSplit | None = None
    client_feature: TFDSFeature | None = None
    """The scalar integer or string feature holding each record's user id."""
    inputs: tuple[TFDSFeature, ...] = Field(min_length=1)
    label: TFDSFeature
    num_classes: int | None = Field(None, ge=2)
    """Classes of ``label``; ``None``: a ``ClassLabel``'s own (required for a plain integer label)."""
    input_scale: float = Field(1.0, gt=0.0)
    """Inputs are multiplied by this (e.g. 1/255 for 8-bit pixel values)."""
    hidden: int = Field(0, ge=0)
    """0: logistic regression (softmax over ``num_classes``); > 0: an MLP with one hidden layer of this width."""

    @model_validator(mode="after")
    def _distinct_features(self) -> TFDSConfig:
        roles = [("inputs", f) for f in self.inputs] + [("label", self.label)]
        roles += [("client_feature", self.client_feature)] if self.client_feature is not None else []
        seen: dict[str, str] = {}
        for role, feature in roles:
            if feature in seen:
                raise ValueError(f"feature {feature!r} is named twice (data.tfds.{seen[feature]} and data.tfds.{role}): "
                                 "the label and the user id must not be inputs")
            seen[feature] = role
        return self


class DataConfig(_Section):
    """Where the StackOverflow files are, which task, and how clients and posts are selected."""

    path: Path = Path("data/synthetic")
    """Folder holding ``stackoverflow.sqlite``, ``stackoverflow.word_count``, ``stackoverflow.tag_count``."""
    generate_if_missing: bool | None = None
    """Generate the synthetic data set (deterministic per ``synthetic_seed``) if the folder has no data
    files: ``true`` anywhere, ``false`` never, ``null`` only into the default ``data/synthetic`` (so a
    typo in ``path`` is an error, not a silently generated data set)."""
    synthetic_clients: int = Field(1000, ge=1)
    """Train users of the synthetic data: the files generated into ``path``, or the on-demand population
    (``source: synthetic``)."""
    synthetic_seed: int = 0
    vocab_size: int = Field(10_000, ge=1)
    num_tags: int = Field(500, ge=1)
    no_tag: Literal["label0", "drop"] = "label0"
    """Posts with no tag in the top ``num_tags``: label 0 (the AdaDPS code's quirk) or dropped."""
    max_clients: int | None = Field(None, ge=1)
    """Use only the first ``max_clients`` training users (sorted ids); the population is this many."""
    max_test_examples: int | None = Field(None, ge=1)
    """Cap on pooled test examples used for evaluation (first ones in client order)."""
    task: str = Field("tag", pattern=r"^(tag|tag_multilabel|next_word|classification|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
    """tag: single label (AdaDPS, softmax, accuracy); tag_multilabel: multi-hot over ``num_tags``
    (Reddi et al., sigmoid, recall@5); next_word: TFF's next-word prediction (LSTM, accuracy
    without pad/OOV/EOS); classification: a TFDS dataset's numeric features and integer label
    (``source: tfds``, the task it implies); or ``package.module:factory``, a user's task:
    ``factory(data_config)`` returns an object implementing :class:`fedprivacy.task.Task` (the data
    is then the user's)."""
    source: Literal["tff-sqlite", "tff-h5", "synthetic", "tfds"] = "tff-sqlite"
    """Example files in ``path``: ``stackoverflow.sqlite`` or TFF's legacy
    ``stackoverflow_{train,held_out,test}.h5``; or ``synthetic``: no example files, the synthetic
    population of ``synthetic_clients`` train users (seed ``synthetic_seed``) generated user by user
    on demand, identical to the stored synthetic data of that seed (tag tasks, natural view; needs
    ``max_test_examples``; the vocabulary's count files are written once under ``path``;
    :mod:`fedprivacy.data.on_demand`); or ``tfds``: a TensorFlow Datasets dataset prepared in
    ``tfds.data_dir`` (section ``tfds``; :mod:`fedprivacy.tfds_task`)."""
    tfds: TFDSConfig | None = None
    """The TFDS dataset of ``source: tfds``: which dataset, splits and features."""
    view: Literal["natural", "adadps"] = "natural"
    """natural: each training user is a client, evaluation on the pooled ``test`` split;
    adadps: the first ``max_clients`` (default 400) training users, each split 80/20 by position
    into its train part (the client) and its test part (pooled for evaluation)."""
    train_fraction: float = Field(0.8, gt=0.0, lt=1.0)
    """Share of each user's posts (first ones) in its train part, ``view: adadps``."""
    client_sample: int | None = Field(None, ge=1)
    """Keep a uniform random subset of this many training users (after ``max_clients``)."""
    client_sample_seed: int = 0
    max_examples_per_client: int | None = Field(None, ge=1)
    """Cap on each client's training posts (its first ones); Reddi et al. use 1000 for next word."""
    public_clients: int = Field(0, ge=0)
    """Load the first this many ``heldout`` users as a public (out-of-distribution) pool."""
    seq_len: int = Field(20, ge=1)
    """next_word: words per sequence (TFF's 20)."""
    cache: bool = True
    """Cache preprocessed splits as memory-mapped arrays (rebuilt when an input file changes)."""
    cache_dir: Path | None = None
    """Cache folder (default: ``<path>/.fedprivacy-cache``)."""

    @model_validator(mode="before")
    @classmethod
    def _tfds_implies_classification(cls, data: Any) -> Any:
        """``source: tfds`` trains ``task: classification`` unless the file names a task itself."""
        if isinstance(data, dict) and data.get("source") == "tfds" and "task" not in data:
            return {**data, "task": "classification"}
        return data

    @model_validator(mode="after")
    def _tfds_options(self) -> DataConfig:
        if self.source != "tfds":
            if self.tfds is not None or self.task == "classification":
                raise ValueError("data.tfds and data.task=classification need data.source=tfds")
            return self
        if self.tfds is None:
            raise ValueError("data.source=tfds needs the data.tfds section (name, data_dir, client_feature, inputs, "
                             "label)")
        if self.task != "classification":
            raise ValueError(f"data.source=tfds trains data.task=classification, got data.task={self.task!r}")
        if self.tfds.client_feature is None:
            raise ValueError("data.tfds.client_feature must name the feature holding the user id with "
                             "data.source=tfds (one federated client per distinct value)")
        unread = [f"data.{name}" for name in ("view", "public_clients", "generate_if_missing")
                  if getattr(self, name) != type(self).model_fields[name].default]
        if unread:
            raise ValueError(f"data.source=tfds does not read {', '.join(unread)} (the public pool is "
                             "data.tfds.public_split)")
        return self

    @model_validator(mode="after")
    def _on_demand_options(self) -> DataConfig:
        if self.source != "synthetic":
            return self
        if self.task == "next_word":
            raise ValueError("data.task=next_word is not available with data.source=synthetic (on-demand users "
                             "serve the tag tasks); generate files with data.source=tff-sqlite instead")
        if self.view != "natural":
            raise ValueError(f"data.view={self.view!r} needs stored files; data.source=synthetic serves the "
                             "natural view")
        if self.client_sample is not None:
            raise ValueError("data.client_sample is not available with data.source=synthetic: set "
                             "data.synthetic_clients (or data.max_clients) to the population you want")
        if self.max_test_examples is None:
            raise ValueError("data.max_test_examples must be set with data.source=synthetic (the pooled test "
                             "split of a large population does not fit in memory; e.g. 10000)")
        return self


class SampleDPClientConfig(_Section):
    """Sample-level (record-level) DP local training (fedprivacy.client.sample_dp; tag task only).

    Each local step Poisson-samples the client's n_i records at q_i = batch_size / n_i, clips each
    unit's gradient to ``clip_norm`` (flat L2), adds N(0, noise_multiplier^2 clip_norm^2) to every
    coordinate of the sum, divides by ``batch_size`` and takes a step of ``optimizer``. Each
    client's record-level epsilon is composed over its rounds and reported in
    ``client_privacy.csv``; the server's user-level DP applies on top, unchanged.
    """

    optimizer: Literal["sgd", "adam", "adambc", "microadam"] = "sgd"
    lr: float = Field(0.1, ge=0.0)
    noise_multiplier: NoiseMultiplier = 1.0
    clip_norm: float = Field(1.0, gt=0.0, le=MAX_NOISE_STD)
    batch_size: float = Field(16.0, gt=0.0)
    """Expected records per step (Poisson); capped at n_i for clients with fewer records."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Records per privacy unit (fixed micro-batches, AdaDPS App. B); None: one record per unit."""
    epochs: float = Field(1.0, gt=0.0)
    """Local epochs: steps = max(1, round(epochs / q_i))."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Accountant of the epsilon each client reports for its round (reply metrics); the run's
    per-client files compose the rounds under every ``privacy.accountants``."""
    target_delta: Delta | None = None
    """One delta for every client's record-level epsilon; None: ``delta_factor / n_i`` (n_i: the client's
    privacy units). Clients with delta >= 1 / n_i are flagged in ``client_privacy.csv`` (``weak_delta``)."""
    delta_factor: float = Field(0.1, gt=0.0, lt=1.0)
    """f of the default per-client delta_i = f / n_i, well below 1 / n_i (Dwork & Roth 2014, §2.3)."""
    disk_kappa: float = Field(1.0, gt=0.0, le=1.0)
    """Local DiSK (arXiv:2410.03883, Alg. 3) on top of ``optimizer``: filter gain kappa; 1 = off.
    Each step combines the per-record gradients at x and at x + disk_gamma d (same batch) before the
    one clip, so the releases, and each client's epsilon, are those without DiSK."""
    disk_gamma: float = 0.5
    """Local DiSK lookahead step along the client's previous local step; non-zero."""

    @model_validator(mode="after")
    def _units_fit_the_batch(self) -> SampleDPClientConfig:
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ValueError(f"client.sample_dp.micro_batch_size={self.micro_batch_size} must be <= "
                             f"client.sample_dp.batch_size={self.batch_size}")
        if self.disk_gamma == 0.0:
            raise ValueError("client.sample_dp.disk_gamma must be non-zero")
        return self


class AdaDPSConfig(_Section):
    """AdaDPS side information (Li et al. 2022, arXiv:2202.05963v2, Alg. 3; fedprivacy.optim.adadps).

    The server builds a PUBLIC preconditioner A before round 1 (from the vocabulary statistics or
    the public pool ``data.public_clients``, never from training clients), sends it to each client
    once, and every local step uses ``grad / A`` (sample-level DP clients: each record's gradient,
    before its clip). Where A came from is written to ``side_information.json``.
    """

    source: Literal["ones", "top_words", "frequency", "tfidf", "rmsprop"] = "top_words"
    """ones: A = 1 (DP-FedAvg exactly); top_words: the paper code's two-level rule (A = 1 for the
    ``top_words`` most frequent words, 1 / ``multiplier`` for the rest); frequency: A proportional
    to each word's frequency (``statistics``), capped; tfidf: A inversely proportional to the
    public pool's summed TF-IDF, capped; rmsprop: A from the second moment of mean gradients on
    the public pool (every coordinate its own A)."""
    top_words: int = Field(100, ge=0)
    multiplier: float = Field(200.0, gt=0.0)
    """top_words: 1 / A of the words outside the top (the federated code's x200)."""
    statistics: Literal["word_count", "public"] = "word_count"
    """frequency: counts from ``stackoverflow.word_count`` (TFF's vocabulary statistics, treated as
    common knowledge as in the paper) or post counts in the public pool."""
    cap: float = Field(1e4, ge=1.0)
    """frequency, tfidf: multipliers 1 / A are kept within [1 / cap, cap]."""
    scale: float = Field(1.0, gt=0.0)
    """A <- scale * A for every source. Where A covers every coordinate (rmsprop with
    ``precondition_bias``) and a client takes one local step, this equals clip_norm * scale with the
    server lr / scale (the step is Delta / scale, clip(Delta / c, C) = clip(Delta, cC) / c and the noise
    scales with C; AdaDPS, arXiv:2202.05963v2, App. B, Alg. 3); the word rules leave the bias at A = 1."""
    estimator: Literal["epoch", "recurrence"] = "epoch"
    """rmsprop: the paper code's full pass (v = mean of squared public batch-mean gradients) or the
    paper's recurrence v <- beta v + (1 - beta) g^2 over the same batches."""
    public_batch_size: int = Field(20, ge=1)
    """rmsprop: posts per public batch (the paper code's ``public_bs``)."""
    beta: float | None = Field(None, ge=0.0, lt=1.0)
    """rmsprop recurrence: constant beta, or None for beta_t = 1 - 1/t (the running mean)."""
    eps: float = Field(1e-5, gt=0.0)
    """rmsprop stabiliser (1e-5 in the paper code's StackOverflow runs)."""
    eps_inside_sqrt: bool = True
    """rmsprop: A = sqrt(v + eps) (paper code) or sqrt(v) + eps (paper, Eq. 5)."""
    refresh_every: int | None = Field(None, ge=1)
    """rmsprop: re-estimate A at the current (released) model every this many rounds; None: once."""
    precondition_bias: bool = False
    """Divide the bias gradients too (every parameter named ``bias`` or ``*.bias``; rmsprop only: the frequency
    rules have no A for the bias)."""

    @model_validator(mode="after")
    def _settings_apply(self) -> AdaDPSConfig:
        # a setting counts when it differs from its default (a serialized config sets every field)
        given = {k for k in self.model_fields_set if getattr(self, k) != type(self).model_fields[k].default}
        unread = given - _ADADPS_SETTINGS[self.source] - {"source", "scale"}
        if self.source == "rmsprop" and self.estimator != "recurrence":
            unread |= {"beta"} & given
        if unread:
            raise ValueError(f"client.adadps.source={self.source!r} does not read "
                             + ", ".join(f"client.adadps.{k}" for k in sorted(unread)))
        return self

    @property
    def needs_public_pool(self) -> bool:
        return self.source in ("tfidf", "rmsprop") or (self.source == "frequency" and self.statistics == "public")


_ADADPS_SETTINGS = {
    "ones": set(), "top_words": {"top_words", "multiplier"}, "frequency": {"statistics", "cap"}, "tfidf": {"cap"},
    "rmsprop": {"estimator", "public_batch_size", "beta", "eps", "eps_inside_sqrt", "refresh_every",
                "precondition_bias"},
}


class CompressionConfig(_Section):
    """Uplink compression with error feedback (DP-MicroAdam's machinery on the client,
    arXiv:2511.20509, Alg. 1 lines 8-13, applied to client updates; fedprivacy.client.compression).

    Each client sends ``s = clip(top_k(Delta + e), C)`` and keeps ``e <- Q(Delta + e - top_k(Delta + e))``
    in its ``Context.state`` across rounds (also rounds it sits out). The server clips and noises as
    always: the noise is dense over every coordinate. Needs ``privacy.placement: central``.
    """

    density: float = Field(0.01, gt=0.0, le=1.0)
    """k / d with k = ceil(density * d) coordinates sent (d = all model parameters)."""
    quantization: Literal["none", "4bit", "4bit_stochastic"] = "4bit"
    """Storage of the residual e: float32, or 4-bit min-max codes per bucket (Alg. 2's Q; round to
    nearest or unbiased stochastic rounding)."""
    bucket_size: int = Field(100_000, ge=1)
    per_tensor: bool = False
    """Top-k per parameter tensor (ceil(density * n_p) each, the paper code) instead of global."""


class ClientConfig(_Section):
    """Local training on each sampled client."""

    epochs: int = Field(5, ge=1)
    batch_size: int = Field(10, ge=1)
    lr: float = Field(30.0, ge=0.0)
    """Client learning rate; 0 is valid (clients then return zero deltas)."""
    sample_dp: SampleDPClientConfig | None = None
    """Train with sample-level DP instead of plain local SGD (``epochs``, ``batch_size`` and ``lr``
    above are then unused)."""
    adadps: AdaDPSConfig | None = None
    """Precondition local steps with public side information (AdaDPS)."""
    compression: CompressionConfig | None = None
    """Compress the upload: top-k with error feedback kept on the client."""


class DiskConfig(_Section):
    """Server-side DiSK (Zhang et al. 2024, arXiv:2410.03883, Alg. 3, on the clients' pseudo-gradients;
    fedprivacy.optim.disk)."""

    kappa: float = Field(0.7, gt=0.0, le=1.0)
    """Filter gain: g~ <- (1 - kappa) g~ + kappa g. kappa = 1 is the base optimizer."""
    gamma: float = 0.5
    """Lookahead step along the previous model change; non-zero (-1 gives STORM)."""

    @model_validator(mode="after")
    def _gamma_nonzero(self) -> DiskConfig:
        if self.gamma == 0.0:
            raise ValueError("server.disk.gamma must be non-zero")
        return self


class MicroAdamConfig(_Section):
    """Server DP-MicroAdam options (arXiv:2511.20509, Alg. 1 from line 8 on; fedprivacy.optim.microadam)."""

    density: float = Field(0.01, gt=0.0, le=1.0)
    ring_size: int = Field(10, ge=1)
    bucket_size: int = Field(100_000, ge=1)
    stochastic_rounding: bool = False
    per_tensor: bool = False
    """Top-k per parameter tensor (the paper code's choice) instead of over the whole vector."""


_OPTIONAL_SERVER_SETTINGS = ("momentum", "beta1", "beta2", "tau", "bias_correction", "gamma_prime", "microadam")


class ServerConfig(_Section):
    """Server optimizer applied to the noised average ``g_t`` (post-processing), optionally after DiSK.

    A setting the chosen optimizer does not read is an error when given explicitly (e.g.
    ``momentum`` with ``adam``, whose momentum is ``beta1``). Unset adaptive settings take each
    optimizer's paper defaults (see ``fedprivacy.optim.factory``).
    """

    optimizer: Literal["sgd", "adam", "yogi", "adagrad", "adambc", "microadam"] | PluginSpec = "sgd"
    """A built-in optimizer, or ``package.module:factory`` of a server step of one's own (a
    ``fedprivacy.optim.factory.ServerOptimizerFactory``, called as ``factory(lr, **settings)`` with the settings
    below that are set)."""
    lr: float = Field(1.0, ge=0.0)
    momentum: float | None = Field(None, ge=0.0, lt=1.0)
    """Heavy-ball momentum (sgd only; 0.9 when not given)."""
    beta1: float | None = Field(None, ge=0.0, lt=1.0)
    beta2: float | None = Field(None, ge=0.0, lt=1.0)
    tau: float | None = Field(None, gt=0.0)
    """Adaptivity outside the square root (adam, yogi, adagrad; microadam's eps)."""
    bias_correction: bool | None = None
    """Adam-style bias correction (adam, yogi: off in Reddi et al.; adambc: its corrected-V variant)."""
    gamma_prime: float | None = Field(None, gt=0.0)
    """DP-FedAdamBC's floor under ``v_hat - Phi`` (default: 0.01 * Phi, Phi = (z C / m)^2)."""
    microadam: MicroAdamConfig | None = None
    disk: DiskConfig | None = None
    """Enable server-side DiSK filtering of the released pseudo-gradients."""

    @model_validator(mode="before")
    @classmethod
    def _sgd_momentum_default(cls, data: Any) -> Any:
        """sgd's momentum defaults to 0.9; every other optimizer keeps it None (so a dump loads back)."""
        if isinstance(data, dict) and data.get("optimizer", "sgd") == "sgd" and data.get("momentum") is None:
            return {**data, "momentum": 0.9}
        return data

    def explicit_settings(self) -> set[str]:
        """The optimizer settings in effect (non-None): given, or sgd's default momentum."""
        return {k for k in _OPTIONAL_SERVER_SETTINGS if getattr(self, k) is not None}

    @model_validator(mode="after")
    def _settings_apply(self) -> ServerConfig:
        from fedprivacy.optim.factory import check_settings

        given = self.explicit_settings()
        if ":" in self.optimizer:  # a plug-in: its factory takes the settings that are set, or refuses them
            if self.microadam is not None:
                raise ValueError(f"server.microadam configures server.optimizer: microadam, not {self.optimizer!r}")
            return self
        if self.optimizer == "adambc":
            given |= {"gamma_prime", "phi"}  # both derived when unset
        try:
            check_settings(self.optimizer, given)
        except ValueError as err:
            raise ValueError(f"server.optimizer={self.optimizer!r}: {err}") from None
        return self


class AdaptiveClipConfig(_Section):
    """Adaptive clipping to a target quantile (Andrew et al. 2021); ``privacy.clip_norm`` is C_0."""

    target_quantile: float = Field(0.5, gt=0.0, lt=1.0)
    """Fraction of updates meant to be unclipped."""
    learning_rate: float = Field(0.2, gt=0.0)
    clipped_count_stddev: float | None = Field(None, gt=0.0)
    """Noise std of the unclipped count; default expected_cohort / 20 (TFF)."""


class MechanismConfig(_Section):
    """Noise across rounds (:mod:`fedprivacy.privacy.correlated`): independent every round, or correlated so that
    most of it cancels in the model's running sum (DP-FTRL's tree, BandMF, BLT)."""

    kind: Literal["independent", "tree", "bandmf", "blt"] = "independent"
    horizon: int | None = Field(None, ge=1)
    """Releases one correlated strategy covers (optimized for, then restarted); default: ``rounds``."""
    bands: int = Field(4, ge=1)
    """BandMF's bands (at most ``privacy.groups``)."""
    buffers: int = Field(3, ge=1)
    """BLT's buffers."""


class CanaryConfig(_Section):
    """Canary clients for the run's empirical privacy estimates (:mod:`fedprivacy.fl.canaries`, docs/audit.md)."""

    count: int = Field(ge=4)
    """Canaries in the population (sampled like users), each included with probability 1/2: an included one sends
    its random direction (clipped to C), an excluded one a zero update."""
    unused: int = Field(100, ge=2)
    """Further random directions that never enter the run (the one-shot estimate's null, with the excluded ones)."""
    seed: int | None = None
    """Seed of the directions and the inclusions, held apart from the run's seed (None: from the OS, kept in the
    checkpoint)."""
    confidence: float = Field(0.95, gt=0.0, lt=1.0)
    """Of the one-shot estimate's interval and of the one-run lower bound."""
    norm: float = Field(2.0, ge=1.0, allow_inf_nan=False)
    """An included canary's raw update norm, in multiples of the round's clip bound C: a correct server clips it
    to exactly C (the estimates do not move), one that does not clip each upload before summing it lets ``norm``
    x C through. What it tests: that every upload is clipped before it is summed; so only under
    ``privacy.placement: central`` (elsewhere the client clips its own upload, as a user's does, before noising
    it). The accounted sensitivity, C, and so the run's claim, do not change."""
    every_round: bool = False
    """Also score every round's model change (an adversary who sees every release): (count + unused) dot products
    of the model's size per round: 8-48 s a round at the quickstart's 5,000,500 parameters and 140 directions on
    2 vCPU (the directions are regenerated each round unless they fit 64 MiB), well under a second at 100,050."""


class SecureAggregationConfig(_Section):
    """SecAgg+ with the distributed Skellam mechanism (fedprivacy.fl.secure_aggregation): the server learns only
    the sum of the clients' noisy integer shares. Needs ``placement: distributed`` and Poisson sampling."""

    threshold: int = Field(ge=2)
    """t: shares needed to rebuild a node's secrets; the fewest survivors a round completes with; more than half of
    ``neighbours`` (each client refuses any other threshold)."""
    neighbours: int = Field(ge=3)
    """k: each node's neighbourhood, itself included (odd; the whole cohort when larger)."""
    bits: int = Field(20, ge=8, le=32)
    """b: the shares and their sum live modulo 2^b."""
    timeout_s: float | None = Field(None, gt=0)
    """Seconds each protocol stage waits for replies (None: until every node answered or was reported gone)."""

    @model_validator(mode="after")
    def _consistent(self) -> SecureAggregationConfig:
        if self.threshold > self.neighbours or self.neighbours % 2 == 0:
            raise ValueError(f"privacy.secure_aggregation needs threshold <= neighbours and neighbours odd, got "
                             f"threshold={self.threshold}, neighbours={self.neighbours}")
        if not 2 * self.threshold > self.neighbours:
            raise ValueError(f"privacy.secure_aggregation.threshold must exceed half of neighbours (2 * threshold > "
                             f"neighbours: else a server lying about dropouts can unmask a client), got threshold="
                             f"{self.threshold}, neighbours={self.neighbours}")
        return self


class PrivacyConfig(_Section):
    """User-level DP: flat L2 clipping, one Gaussian draw on the sum, fixed divisor, accounting."""

    clip_norm: float = Field(10.0, gt=0.0, le=MAX_NOISE_STD)
    noise_multiplier: NoiseMultiplier | Literal["auto"] = 1.0
    """z = noise std / clip_norm on the SUM of clipped updates; 0 is valid (no privacy). ``auto``:
    calibrated when the run starts (the population is known then) so that epsilon after ``rounds``
    rounds under ``budget_accountant`` is within 1% below ``target_epsilon``."""
    sampling: Literal["poisson", "fixed", "cyclic_poisson", "min_separated"] | PluginSpec = "poisson"
    """poisson: each user joins independently with q = expected_cohort / population;
    fixed: exactly expected_cohort users without replacement; cyclic_poisson and min_separated: the users in
    ``groups`` groups take turns (one user joins at most every ``groups`` rounds), Poisson with
    q = expected_cohort * groups / population or expected_cohort users without replacement within the group
    (fedprivacy.privacy.sampling); or ``package.module:factory`` of a schedule of one's own (a
    ``fedprivacy.privacy.sampling.ScheduleFactory``, built with population, expected_cohort, the seed, secure_noise
    and groups, and accounted as its ``round_event`` says)."""
    groups: int = Field(1, ge=1)
    """b, the number of groups of the cyclic samplings (their min separation)."""
    mechanism: MechanismConfig = MechanismConfig()
    """Independent noise every round (default) or a correlated mechanism, e.g. ``{kind: blt, buffers: 3}`` with
    ``sampling: min_separated``; BandMF with ``sampling: cyclic_poisson`` is accounted with amplification."""
    expected_cohort: int = Field(100, ge=1)
    """m: expected (poisson) or exact (fixed) cohort size; also the fixed divisor."""
    delta: Delta | None = None
    """Target delta; default 1 / population (a delta >= 1 / population is logged as a WARNING)."""
    accountants: tuple[Literal["rdp", "prv", "pld"], ...] = ("rdp", "prv", "pld")
    budget_accountant: Literal["rdp", "prv", "pld"] = "rdp"
    """Accountant whose epsilon is checked against ``target_epsilon``."""
    target_epsilon: float | None = Field(None, gt=0.0)
    """Stop before the round that would push epsilon above this."""
    placement: Literal["central", "distributed", "local"] = "central"
    """Who adds the noise (fedprivacy.privacy.placement): the server (central); each client its
    share N(0, z^2 C^2 / m), assuming secure aggregation (distributed); each client N(0, z^2 C^2) on
    its own upload, with a per-client epsilon (local). Clients clip in the last two."""
    secure_noise: bool = False
    """Seed the noise generator from the OS's cryptographic source instead of the run seed."""
    secure_aggregation: SecureAggregationConfig | None = None
    """SecAgg+ with distributed Skellam noise instead of Gaussian shares summed in the clear (needs
    ``placement: distributed``, ``sampling: poisson``, independent noise, ``budget_accountant: rdp``)."""
    adaptive_clipping: AdaptiveClipConfig | None = None
    noise_cohort: int | None = Field(None, ge=1)
    """Large-cohort emulation (pfl-research's ``noise_cohort_size``): simulate ``expected_cohort``
    clients but add noise as for a cohort of ``noise_cohort`` (std on the sum ``z C m / M``). The
    reported epsilon then refers to a DEPLOYMENT with that cohort and ``noise_population`` users (and, for the
    cyclic schedules, the same ``groups``), never to this simulation. Works with every mechanism kind."""
    noise_population: int | None = Field(None, ge=1)
    """Population of the emulated deployment (default: the simulated population)."""
    canaries: CanaryConfig | None = None
    """Canary clients counted in the population, for the run's empirical epsilon (docs/audit.md)."""
    noise_stream: PluginSpec | None = None
    """``module:factory`` of the server's noise across rounds (a ``fedprivacy.privacy.noise.NoiseStream``,
    built as ``factory(seed, device=..., secure=...)``); None: independent Gaussian noise every round.
    Needs central placement, a fixed clip and a given noise_multiplier (``auto`` calibrates independent noise)."""
    aggregation: PluginSpec | None = None
    """``module:factory`` of how the uploads become one release (a ``fedprivacy.fl.aggregation.Aggregation``, built
    as ``factory()``); None: the plain clipped sum, or ``secure_aggregation``. Needs a given noise_multiplier (``auto``
    calibrates the plain sum's Gaussian mechanism) and no ``secure_aggregation``."""

    @property
    def accounting_cohort(self) -> int:
        """The cohort the privacy claim refers to: ``noise_cohort`` when emulating, else ``expected_cohort``."""
        return self.noise_cohort or self.expected_cohort

    @property
    def simulated_noise_multiplier(self) -> float:
        """Noise multiplier applied to the simulated sum: ``z * m / M`` (``z`` without emulation)."""
        return self.noise_multiplier * self.expected_cohort / self.accounting_cohort

    @property
    def count_stddev(self) -> float:
        """sigma_b of the adaptive clipping count (configured, or m / 20)."""
        a = self.adaptive_clipping
        return a.clipped_count_stddev if a and a.clipped_count_stddev else self.expected_cohort / 20.0

    @model_validator(mode="after")
    def _mechanism_is_accountable(self) -> PrivacyConfig:
        cyclic = self.sampling not in ("poisson", "fixed")  # a plug-in's groups and separation are its own
        if self.groups != 1 and not cyclic:
            raise ValueError(f"privacy.groups={self.groups} needs privacy.sampling: cyclic_poisson or min_separated, "
                             f"got {self.sampling!r}")
        kind = self.mechanism.kind
        if self.secure_aggregation is not None:
            wrong = {name: value for name, value, ok in (
                ("placement", self.placement, "distributed"), ("sampling", self.sampling, "poisson"),
                ("mechanism.kind", kind, "independent"), ("budget_accountant", self.budget_accountant, "rdp"),
                ("noise_stream", self.noise_stream, None)) if value != ok}
            if wrong:
                raise ValueError("privacy.secure_aggregation needs placement: distributed, sampling: poisson, independent "
                                 "noise and budget_accountant: rdp (the only accountant of Skellam noise); got "
                                 + ", ".join(f"privacy.{k}={v!r}" for k, v in wrong.items()))
        if kind == "independent":
            return self
        if not cyclic:
            raise ValueError(f"privacy.mechanism.kind={kind!r} needs privacy.sampling: min_separated or cyclic_poisson, "
                             f"got {self.sampling!r} (it bounds no user's participations: the strategy's sensitivity "
                             "is unbounded)")
        if self.noise_stream is not None:
            raise ValueError(f"privacy.mechanism.kind={kind!r} and privacy.noise_stream both set the server's noise: "
                             "choose one")
        if self.placement != "central" or self.adaptive_clipping is not None:
            raise ValueError(f"privacy.mechanism.kind={kind!r} needs privacy.placement: central and no "
                             "privacy.adaptive_clipping (client shares and the clip count are independent noise)")
        if kind == "bandmf" and self.mechanism.bands > self.groups:
            raise ValueError(f"privacy.mechanism.bands={self.mechanism.bands} must be <= privacy.groups={self.groups} "
                             "(columns of a strategy with more bands than the min separation overlap)")
        if self.budget_accountant == "prv":
            raise ValueError(f"privacy.budget_accountant='prv' cannot account privacy.mechanism.kind={kind!r} (Opacus' "
                             "PRV models Poisson-subsampled Gaussians only): use rdp or pld")
        return self

    @model_validator(mode="after")
    def _budget_accountant_is_computed(self) -> PrivacyConfig:
        if self.noise_stream is not None and (self.noise_multiplier == "auto" or self.placement != "central"
                                              or self.adaptive_clipping is not None):
            raise ValueError(f"privacy.noise_stream={self.noise_stream!r} needs a given privacy.noise_multiplier (auto "
                             "calibrates independent noise), placement: central and no privacy.adaptive_clipping")
        if self.aggregation is not None and (self.noise_multiplier == "auto" or self.secure_aggregation is not None):
            raise ValueError(f"privacy.aggregation={self.aggregation!r} needs a given privacy.noise_multiplier (auto "
                             "calibrates the plain sum) and no privacy.secure_aggregation (both sum the uploads)")
        if self.noise_multiplier == "auto":
            if self.target_epsilon is None:
                raise ValueError("privacy.noise_multiplier='auto' needs privacy.target_epsilon (the budget to calibrate to)")
            return self  # the remaining checks run again once the run has calibrated z
        check_noise_std(self.noise_multiplier, self.clip_norm, "privacy.")
        if self.budget_accountant not in self.accountants:
            raise ValueError(
                f"privacy.budget_accountant={self.budget_accountant!r} must be one of "
                f"privacy.accountants={list(self.accountants)}"
            )
        if self.adaptive_clipping is not None and 0 < self.noise_multiplier and self.noise_multiplier >= 2 * self.count_stddev:
            raise ValueError(
                f"privacy.noise_multiplier={self.noise_multiplier} must be below 2 * adaptive_clipping."
                f"clipped_count_stddev = {2 * self.count_stddev} (Andrew et al. Thm. 1)"
            )
        if self.placement != "central" and (self.adaptive_clipping is not None or self.noise_cohort is not None):
            raise ValueError(f"privacy.placement={self.placement!r} works with a fixed clip norm and no large-cohort "
                             "emulation (privacy.adaptive_clipping and privacy.noise_cohort need placement: central)")
        if self.noise_population is not None and self.noise_cohort is None:
            raise ValueError("privacy.noise_population needs privacy.noise_cohort (large-cohort emulation)")
        if self.noise_cohort is not None:
            if self.adaptive_clipping is not None:
                raise ValueError("privacy.noise_cohort (emulation) with privacy.adaptive_clipping is not supported yet")
            if self.noise_cohort < self.expected_cohort:
                raise ValueError(f"privacy.noise_cohort={self.noise_cohort} must be >= privacy.expected_cohort")
            if self.noise_population is not None and self.noise_population < self.noise_cohort:
                raise ValueError(f"privacy.noise_population={self.noise_population} must be >= privacy.noise_cohort")
        if self.sampling == "fixed" and set(self.accountants) != {"rdp"}:
            raise ValueError(
                "privacy.accountants must be [rdp] with privacy.sampling='fixed': PRV and PLD here model "
                "Poisson sampling only (use sampling: poisson for PRV/PLD)"
            )
        return self


class RayConfig(_Section):
    """Resources per ClientApp on Flower's Simulation Engine."""

    num_cpus: float = Field(1.0, gt=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    address: str | None = Field(None, min_length=1)
    """Ray cluster to run the ClientApps on, passed as ``ray.init(address=...)``: ``HOST:PORT`` of a
    cluster's head (its GCS port, ``ray start --head --port PORT``; run fedprivacy on a node of that
    cluster) or ``auto`` (the cluster last started with ``ray start`` on this machine). ``None``:
    Ray's default, i.e. ``RAY_ADDRESS`` if set, else that last ``ray start`` cluster if one runs, else
    a new Ray instance private to this run (stopped at the end). See docs/DEPLOYMENT.md §5."""


class TrackingConfig(_Section):
    """Where a run's per-round metrics and resolved config are also logged (docs/TRACKING.md; needs the
    ``tracking`` extra). Off by default; it changes no result, so a resume or a study may switch it."""

    tensorboard: bool = False
    """TensorBoard event files in ``<output_dir>/tensorboard``."""
    mlflow: bool = False
    """One MLflow run (its id kept in ``<output_dir>/tracking.json``, which a resume continues)."""
    mlflow_uri: str | None = Field(None, min_length=1)
    """An MLflow tracking URI (``file:``, ``sqlite:///``, ``http://``) or a folder; ``None``: the folder
    ``<output_dir>/mlruns`` (a study: ``<study output_dir>/mlruns``)."""
    experiment: str | None = Field(None, min_length=1)
    """The MLflow experiment; ``None``: the run folder's name (a study: the study's name)."""


class RunConfig(_Section):
    """One federated training run."""

    seed: int = 0
    rounds: int = Field(40, ge=1)
    eval_every: int = Field(5, ge=1)
    engine: Literal["inprocess", "ray"] = "inprocess"
    device: str = "cpu"
    """Where the model and its tensors live: ``cpu``, ``cuda`` (the current GPU), ``cuda:N`` or ``mps``.
    Whether this machine has it is checked when a run starts (:func:`fedprivacy.devices.check_run_device`),
    not here, so a config written for a GPU machine still parses on a laptop."""
    num_threads: int | None = Field(1, ge=1)
    """torch intra-op threads in this process (``None``: torch's default). Per-client work is
    small sparse ops, which threads slow down more than they help (see BENCHMARKS.md)."""
    processes: int | None = Field(None, ge=1)
    """In-process engine on the CPU: how many cores run the clients. ``None`` (default): every core
    this run may use (:func:`fedprivacy.engines.processes.run_processes`; ``fedprivacy compare``
    splits them between its parallel runs); ``1``: one core. One-at-a-time clients run on this
    process and ``processes - 1`` forked workers (:mod:`fedprivacy.engines.processes`; a round too
    small to pay the hand-over runs in this process alone); a cohort trained together
    (``cohort_batching``) runs its chunks on ``processes`` threads. Results are bit-identical for any
    number. Other engines and devices: 1 (``device: cpu`` only, as CUDA does not survive a fork)."""
    cohort_batching: Literal["auto", "on", "off"] = "auto"
    """In-process engine: train a round's clients together, as one batched computation over their
    stacked parameters (:mod:`fedprivacy.engines.cohorts`); each step equals one-at-a-time local SGD within float
    rounding (at a client lr where local SGD is unstable the steps amplify that rounding, so whole updates agree only
    statistically: docs/engines.md). ``auto``: where supported and measured faster (small dense models; the
    rule is in :func:`fedprivacy.engines.cohorts.cohort_trainer`); ``on``: wherever supported (an
    error names what is not); ``off``: one client at a time."""
    output_dir: Path = Path("runs/quickstart")
    checkpoint_every: int = Field(5, ge=1)
    """Checkpoint (model, server step, ledger, metrics rows; 40 MB for the quickstart's model) after every this many
    rounds, at a graceful stop and at the end. Every release is in ``releases.jsonl`` before its noise is drawn, so a
    crash between checkpoints loses no spend: ``--resume`` accounts those releases and re-runs their rounds (up to
    ``checkpoint_every - 1``) with re-keyed noise and cohorts. Default 5, the evaluated rounds of ``eval_every: 5``."""
    round_timeout_s: float | None = Field(None, gt=0.0)
    """Stop waiting for a round's replies after this many seconds (``None``: wait for all). Clients
    that have not replied by then are dropouts: they contribute zero, noise and divisor unchanged.
    Useful under deployment, where a SuperNode that dies mid-round would otherwise be waited for."""
    data: DataConfig = DataConfig()
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    ray: RayConfig = RayConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("cohort_batching", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        """YAML reads a bare ``on`` / ``off`` as a boolean."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if not DEVICE_PATTERN.fullmatch(device):
            raise ValueError("must be cpu, cuda, cuda:N (N = 0, 1, ...) or mps")
        return device

    @model_validator(mode="after")
    def _gpus_fit_the_engine(self) -> RunConfig:
        if self.engine != "ray" or not self.device.startswith("cuda"):
            return self
        if self.ray.num_gpus == 0:
            raise ValueError(f"device={self.device!r} with engine 'ray' needs ray.num_gpus > 0 (the GPU share of "
                             "each client, e.g. 0.25 for four clients per GPU): Ray hides the GPUs from a "
                             "ClientApp that reserves none")
        if self.device not in ("cuda", "cuda:0"):
            raise ValueError(f"device={self.device!r} with engine 'ray': Ray shows each ClientApp the GPU it "
                             "assigned as cuda:0, so use device: cuda (CUDA_VISIBLE_DEVICES chooses Ray's GPUs)")
        return self

    @model_validator(mode="after")
    def _processes_fit_the_engine(self) -> RunConfig:
        if (self.processes or 1) > 1 and self.engine != "inprocess":
            raise ValueError(f"processes={self.processes} applies to engine 'inprocess' only (engine {self.engine!r} "
                             "places clients itself: see ray.num_cpus)")
        if (self.processes or 1) > 1 and self.device != "cpu":
            raise ValueError(f"processes={self.processes} needs device 'cpu' (got {self.device!r}): worker processes "
                             "are forked and CUDA cannot be used after a fork; use processes: 1 on a GPU")
        return self

    @model_validator(mode="after")
    def _cohort_batching_fits_the_engine(self) -> RunConfig:
        if self.cohort_batching == "on" and self.engine != "inprocess":
            raise ValueError(f"cohort_batching='on' needs engine 'inprocess' (got engine {self.engine!r}): the "
                             "cohort trains in this process")
        return self

    @model_validator(mode="after")
    def _client_methods_fit_the_run(self) -> RunConfig:
        a = self.client.adadps
        if a is not None and self.data.source == "tfds":
            if a.source != "rmsprop":
                raise ValueError(f"client.adadps.source={a.source!r} is a rule over word indices; with data.source=tfds "
                                 "use client.adadps.source=rmsprop (one A per coordinate, from the public pool)")
            if self.data.tfds.public_split is None:
                raise ValueError("client.adadps.source='rmsprop' estimates A on the public pool: set "
                                 "data.tfds.public_split (records disjoint from data.tfds.train_split)")
        elif a is not None and self.data.task not in ("tag", "tag_multilabel"):
            raise ValueError(f"client.adadps needs a bag-of-words task (data.task: tag or tag_multilabel; its A "
                             f"preconditions the word-indexed weight), got data.task={self.data.task!r}")
        elif a is not None and a.needs_public_pool and self.data.public_clients == 0:
            raise ValueError(f"client.adadps.source={a.source!r} estimates A on the public pool: set "
                             "data.public_clients > 0 (held-out users, never training clients)")
        if self.client.compression is not None and self.privacy.placement != "central":
            raise ValueError(f"client.compression needs privacy.placement='central' (got {self.privacy.placement!r}): "
                             "client-side noise would have to precede the data-dependent top-k")
        return self

    @model_validator(mode="after")
    def _correlated_noise_fits_the_run(self) -> RunConfig:
        kind = self.privacy.mechanism.kind
        if kind != "independent" and self.server.disk is not None:
            raise ValueError(f"server.disk models noise independent across rounds; privacy.mechanism.kind={kind!r} "
                             "correlates it (use one or the other)")
        return self

    @model_validator(mode="after")
    def _secure_aggregation_fits_the_run(self) -> RunConfig:
        if self.privacy.secure_aggregation is None:
            return self
        clashes = [name for name, on in (("client.sample_dp", self.client.sample_dp is not None),
                                          ("server.disk", self.server.disk is not None),
                                          ("client.compression", self.client.compression is not None),
                                          ("processes > 1", (self.processes or 1) > 1),
                                          ("engine: ray", self.engine == "ray")) if on]
        if clashes:
            raise ValueError(f"privacy.secure_aggregation does not work with {', '.join(clashes)} (the masked upload "
                             "carries one update and nothing else; its protocol runs in-process or on SuperNodes)")
        return self

    @model_validator(mode="after")
    def _sample_dp_fits_the_run(self) -> RunConfig:
        if self.client.sample_dp is None:
            return self
        if self.data.task != "tag":
            raise ValueError(f"client.sample_dp needs data.task='tag' (softmax regression's exact per-record "
                             f"gradients), got data.task={self.data.task!r}")
        if self.server.disk is not None:
            raise ValueError("client.sample_dp with server.disk is not supported (server DiSK's two client passes "
                             "would be two releases of the same records); for DiSK as each client's local "
                             "record-level optimizer set client.sample_dp.disk_kappa < 1 (and disk_gamma)")
        if self.privacy.placement == "local":
            raise ValueError("client.sample_dp with privacy.placement='local' is not supported (both report a "
                             "per-client epsilon, for different neighbouring units)")
        return self

    @model_validator(mode="after")
    def _canaries_fit_the_run(self) -> RunConfig:
        p = self.privacy
        if p.canaries is None:
            return self
        if self.client.sample_dp is not None:
            raise ValueError("privacy.canaries with client.sample_dp: a canary trains on no records, so it has no "
                             "record-level event, and the strategy rejects a reply without one")
        if p.canaries.norm != CanaryConfig.model_fields["norm"].default and p.placement != "central":
            raise ValueError(f"privacy.canaries.norm={p.canaries.norm} tests the server's per-upload clipping, which "
                             f"only privacy.placement='central' has: under {p.placement!r} the canary's client clips "
                             "its own update before noising it, as a user's does; leave norm at its default")
        return self

    def to_json(self) -> str:
        """Serialise (round-trips through :func:`config_from_json`)."""
        return self.model_dump_json()


def plugins(cfg: RunConfig) -> dict[str, str]:
    """The fields of ``cfg`` that name a plug-in, ``package.module:factory``, with their values: ``data.task`` (a
    user's task), ``privacy.noise_stream``, ``privacy.aggregation``, ``privacy.sampling`` and ``server.optimizer``. A
    run imports each such module and calls the factory: a config file naming a plug-in runs that code."""
    named = {"data.task": cfg.data.task, "privacy.noise_stream": cfg.privacy.noise_stream,
             "privacy.aggregation": cfg.privacy.aggregation,
             "privacy.sampling": cfg.privacy.sampling, "server.optimizer": cfg.server.optimizer}
    return {field: value for field, value in named.items() if value is not None and ":" in value}


def check_plugins(cfg: RunConfig, allowed: bool, opt_in: str = "--allow-plugins") -> None:
    """Refuse a config naming a plug-in (:func:`plugins`) unless its runner opted in (``allowed``; ``opt_in`` says
    how). The opt-in is the runner's, never the file's: a file that could allow itself would allow anything.

    Raises:
        ConfigError: one line naming the field and the opt-in.
    """
    named = plugins(cfg)
    if named and not allowed:
        field, value = next(iter(named.items()))
        raise ConfigError(f"{field}={value!r} names a plug-in: this config imports and runs that code; pass "
                          f"{opt_in} to run a config you trust with it")


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one mapping with dotted keys (``{"server": {"lr": 1}}`` -> ``{"server.lr": 1}``)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_differences(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted field -> ``(old, new)`` for every value that differs between two config trees (dicts)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: dict[str, tuple[Any, Any]] = {}
        for key in sorted(set(old) | set(new), key=str):
            out |= config_differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return {} if old == new else {prefix.rstrip("."): (old, new)}


def _format_validation_error(err: ValidationError, source: str) -> str:
    """One line per field; a union's alternatives (``float | 'auto'``) share one line, joined with "or"."""
    problems: dict[str, tuple[list[str], Any]] = {}
    for e in err.errors():
        # a union's alternatives appear in the location as tags such as "constrained-float", not field names
        field = ".".join(str(p) for p in e["loc"] if not isinstance(p, str) or p.isidentifier()) or "<root>"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        problems.setdefault(field, ([], e.get("input")))[0].append(msg)
    lines = [f"invalid configuration ({source}):"]
    for field, (msgs, given) in problems.items():
        said = " or ".join([msgs[0], *(m.removeprefix("Input should be ") for m in msgs[1:])])
        lines.append(f"  {field}: {said}" + ("" if said == "unknown field" else f" (got {given!r})"))
    return "\n".join(lines)


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key=value (e.g. privacy.noise_multiplier=0)")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {p!r} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key!r}: the value {raw!r} is not valid YAML ({err.problem})") from None


def validate_tree(model: type[M], tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (),
                  source: str = "config", what: str = "configuration") -> M:
    """Validate a nested dict plus ``key=value`` overrides into ``model`` (errors name the field)."""
    tree = json.loads(json.dumps(tree, default=str))  # deep copy, plain types
    for assignment in overrides:
        _apply_override(tree, assignment)
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source).replace("invalid configuration", f"invalid {what}", 1)) \
            from None


def read_yaml_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The mapping at the top of a YAML file (``ConfigError`` naming the file otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} file {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} file {path} must hold a mapping at the top level")
    return tree


def build_config(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "config") -> RunConfig:
    """Validate a nested dict plus ``key=value`` overrides into a :class:`RunConfig`."""
    return validate_tree(RunConfig, tree, overrides, source)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML config file and apply overrides."""
    return build_config(read_yaml_mapping(path), overrides, source=str(path))


def config_from_json(text: str) -> RunConfig:
    """Inverse of :meth:`RunConfig.to_json`."""
    return build_config(json.loads(text), source="json")
