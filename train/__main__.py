"""python -m train [--config NAME_OR_PATH] [--workdir DIR] [--config.KEY=VALUE ...]

Trains, evaluates and writes summary.json into the workdir; running the same command again
resumes from its newest checkpoint. With no arguments: the `default` config (a tiny
encoder-decoder on toy_translation) into ./runs/default. Overrides follow ml_collections'
convention, e.g. `--config.num_train_steps=500 --config.model_overrides.d_model=64`.

Exit status (`train.cli_errors`):
    0    the run finished (summary.json holds its results).
    1    the run failed while training: a loss, parameters or optimiser state that are not
         finite (the last good checkpoint is kept; one `error: ...` line), or a bug: its
         traceback, then `error: internal error (a bug in jax-transformer-zoo or a library
         it uses): TYPE: MESSAGE`.
    2    an error the user can fix (`models.errors.UserError`, or an OSError), found before
         or during the run: a bad config value or argument, a missing or unwritable path (a
         full disk included), a workdir in use by another run, checkpoints that are
         unusable or belong to another model. One `error: ...` line on stderr; `--verbose`
         adds the traceback.
    128+N    stopped by signal N after saving a checkpoint and exporting the model: 143 for
         SIGTERM (a preempted job), 130 for Ctrl-C. summary.json says "preempted": true;
         running the same command again resumes.
"""

from __future__ import annotations

import os
import re
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from models.errors import UserError
from train import cli_errors, configs

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "run directory (default ./runs/<config name>)")
flags.DEFINE_bool("verbose", False, "with an error, print its traceback too (and log the "
                  "traceback of each checkpoint set aside)")



def _exit(error: BaseException, *, verbose: bool = False) -> SystemExit:
    """Reports `error` (`train.cli_errors.report`) and returns the SystemExit to raise: its
    status, its text the error's."""
    exit_ = SystemExit(f"error: {error}")
    exit_.code = cli_errors.report(error, verbose=verbose)
    return exit_


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` given as `flag=VALUE` or `flag VALUE` (the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _config_name(argv: list[str]) -> str:
    return _flag_value(argv, "--config") or "default"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    name = _config_name(argv[1:])
    try:
        config = configs.get(name)
    except (UserError, OSError) as e:
        raise _exit(e) from None
    # `--config NAME` selects the file; what ml_collections parses is only the overrides,
    # and it looks for them in the argv it is given (sys.argv by default).
    argv = [a for i, a in enumerate(argv) if not (a == "--config" or a.startswith("--config=")
                                                  or (i > 0 and argv[i - 1] == "--config"))]
    try:
        _make_room_for_model_overrides(config, argv)
    except UserError as e:
        raise _exit(e) from None
    if FLAGS.is_parsed():           # called again in one process (tests): start afresh
        FLAGS.unparse_flags()
    if "config" in FLAGS:
        delattr(FLAGS, "config")
    config_flags.DEFINE_config_dict("config", config, "the experiment config", sys_argv=argv)
    app.run(lambda args: _run(name, args), argv=argv)


def _make_room_for_model_overrides(config, argv: list[str]) -> None:
    """Adds each `--config.model_overrides.KEY` the config file did not set, holding the
    preset's value: ml_collections only overrides keys that exist, and takes their type
    from the value there. KEY must be a `TransformerConfig` field.

        --config.model_overrides.dropout_rate=0.2   (the lm1b config sets none)
        -> config.model_overrides.dropout_rate = 0.0 (gpt2-small's), then 0.2 from the flag
    """
    import models
    from models.config import check_keys
    preset = None
    for arg in argv:
        m = re.match(r"--config\.model_overrides\.([A-Za-z_]\w*)(=|$)", arg)
        if not m or m.group(1) in config.model_overrides:
            continue
        check_keys({m.group(1): None})
        if preset is None:
            preset = models.get_config(_flag_value(argv, "--config.model") or config.model)
        with config.unlocked():
            config.model_overrides[m.group(1)] = getattr(preset, m.group(1))


def _without_orbax_tracebacks(record) -> bool:
    """Keeps orbax's log line, drops its traceback (the error line says what failed)."""
    if f"{os.sep}orbax{os.sep}" in record.pathname:
        record.exc_info, record.exc_text = None, None
    return True


def _run(name: str, args: list[str]) -> int:
    """Trains; returns the exit status (see the module docstring)."""
    import logging as py_logging

    from absl import logging

    from train.trainer import train_and_evaluate
    verbose = FLAGS.verbose
    if args[1:]:
        raise _exit(UserError(f"unexpected argument {args[1]!r}: python -m train takes only "
                              "flags (--config NAME_OR_PATH, --workdir DIR, --config.KEY=VALUE,"
                              " --verbose)"))
    if not FLAGS["verbosity"].present:   # TFDS and orbax log every file at INFO; -v 0 shows it
        logging.set_verbosity(logging.WARNING)
    if verbose:
        py_logging.getLogger("train").setLevel(py_logging.DEBUG)
    else:       # orbax logs a failed write from each of its threads, traceback and all
        py_logging.getLogger("absl").addFilter(_without_orbax_tracebacks)
    config = FLAGS.config
    workdir = FLAGS.workdir or os.path.join("runs", os.path.basename(name).removesuffix(".py"))
    if config.get("compile_cache", True) is not False:   # a bad value is named by the run
        import models
        models.use_compile_cache()
    try:
        summary = train_and_evaluate(config, workdir)
    except Exception as e:      # the status says whose mistake it was (train.cli_errors)
        raise _exit(e, verbose=verbose) from None
    if summary.get("preempted"):        # a signal (not max_train_seconds) stopped it
        return 128 + signal.Signals[summary["stopped_by"]].value
    test = summary.get("test", {})
    val = summary["validation"]
    print(f"done: step {summary['step']} in {summary['train_seconds']:.0f} s of training; "
          f"validation loss {val['loss']:.3f}, accuracy {val['accuracy']:.3f}"
          + "".join(f"; test {k} {v:.4g}" for k, v in test.items())
          + f"\nsummary: {os.path.join(workdir, 'summary.json')}; model: {summary['model']}")
    return 0


if __name__ == "__main__":
    main()
