"""usage: rlrepro COMMAND [ARGS ...]

rlrepro: GRPO reinforcement learning for LLMs, bitwise reproducible. Commands:

  train     recipe=NAME [key=value ...]       run a recipe; hydra overrides follow, --cfg prints the config
  diff      RUN_A RUN_B [--json] [--strict]   compare two runs: exit 0 identical, 1 diverged, 2 error
  verify    RUN [--from-step K] [--steps N]   re-execute recorded steps, diff them: exit as diff, 3 re-execution failed
  show      RUN [--step K] [--n 8]            print a step's prompts, completions, rewards and advantages
  plot      RUN [RUN ...] [--out DIR]         PNG overlays of the runs' curves, first divergence marked
  generate  [--model DIR] [--prompt TEXT]     sample from a model, a run or a checkpoint (tiny model by default)
  export    RUN [--step K] OUT                write a run's checkpoint as an HF model directory (transformers, vLLM)
  eval      RUN [--step K] [--source FILE]    evaluate a checkpoint on eval.source (or FILE): the eval/* numbers
  recipes                                     list the shipped recipes, one line each

rlrepro train|diff|verify|show|plot|generate|export|eval --help shows that command's options;
rlrepro train recipe=NAME --cfg prints every config key of a recipe.
"""
from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_description(name: str) -> str:
    """One line from the header comment of ``recipes/NAME.yaml``: the first sentence of its first paragraph (all
    of that paragraph when it has no sentence end); "" when the file has no header comment."""
    import re

    lines = []
    for line in (RECIPES_DIR / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text:
            if lines:
                break
            continue
        lines.append(text)
    if not lines:
        return ""
    return re.split(r"(?<=[.!?])\s", " ".join(lines), maxsplit=1)[0]


def cmd_recipes() -> int:
    names = list_recipes()
    width = max((len(n) for n in names), default=0)
    for name in names:
        print(f"{name:<{width}}  {recipe_description(name) or '(no header comment)'}".rstrip())
    return 0


def compose_config(overrides: list[str]):
    """Compose ``recipe=NAME`` plus overrides against the schema; any problem raises ConfigError before work.
    Returns the composed (resolved) DictConfig; :func:`rlrepro.orchestration.config.validate` has run on it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlrepro.orchestration.config import ConfigError, RunSchema, migrate_override, validate

    _refuse_flag_forms(overrides)
    recipe = None
    rest = []
    for item in overrides:
        if item.startswith("recipe="):
            recipe = item.split("=", 1)[1]
        else:
            rest.append(migrate_override(item))
    available = list_recipes()
    if recipe is None:
        raise ConfigError(_no_recipe_message(overrides, available))
    if recipe not in available:
        close = difflib.get_close_matches(recipe.lower(), available, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown recipe {recipe!r}{hint}; available: {', '.join(available)}")
    schema = OmegaConf.structured(RunSchema)
    _refuse_added_keys(rest, schema, recipe)
    rest = [_into_mapping(item, schema) for item in rest]
    _check_override_grammar(rest, recipe)
    ConfigStore.instance().store(name="rlrepro_schema", node=RunSchema)
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
            cfg = compose(config_name=recipe, overrides=rest + [f"recipe={recipe}"])
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        # hydra's advice to add the key with "+key=value" is wrong here: the schema refuses keys it does not have
        msg = "\n".join(line for line in str(e).strip().splitlines()
                        if not line.startswith("To append to your config use"))
        if e.__cause__ is not None:
            msg += f" ({str(e.__cause__).splitlines()[0]})"
        hints = [_unknown_key_hint(o.split("=", 1)[0].lstrip("+~"), schema) for o in rest]
        hint = "".join(f"; {h}" for h in hints if h)
        raise ConfigError(f"bad override for recipe {recipe}: {msg}{hint}. "
                          f"`rlrepro train recipe={recipe} --cfg` prints every key") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"recipe {recipe} needs values for {', '.join(missing)}: add "
                          + " ".join(f"{k}=..." for k in missing))
    validate(cfg)
    set_keys = {o.lstrip("+~").split("=", 1)[0] for o in rest}
    if "model.path" in set_keys and cfg.model.get("init") == "tiny" and cfg.model.get("path"):
        # model.init=tiny makes its own tiny random model: the path would be ignored without a word
        raise ConfigError(f"model.path={cfg.model.path} is not used with model.init=tiny (recipe {recipe} builds "
                          "a tiny random model); add model.init=pretrained to train that model (or model.init=random "
                          "for its shape with seeded random weights)")
    tiny_keys = sorted(k for k in set_keys if k.startswith("model.tiny_overrides."))
    if tiny_keys and cfg.model.get("init") != "tiny":
        # the overrides shape the tiny model that model.init=tiny builds; with another init they change nothing
        # (the whole mapping may be set, e.g. model.tiny_overrides={} to clear a recipe's)
        raise ConfigError(f"{tiny_keys[0]} is not used with model.init={cfg.model.get('init')} (the weights come from "
                          "model.path); drop it, or set model.init=tiny to build a tiny random model")
    return cfg


def _refuse_flag_forms(args: list[str]) -> None:
    """Overrides written as another CLI's options: ``--steps 3``, ``--train.steps=3``, ``train.steps 3``,
    ``train.steps = 3``. hydra's grammar refuses each with a lexer message (``token recognition error at: '-'``) and
    the quoting advice of :func:`_check_override_grammar` would be wrong for them: name the ``KEY=VALUE`` form
    instead, with the schema's key when the name is close to one (``--steps`` -> ``train.steps``)."""
    from omegaconf import OmegaConf

    from rlrepro.orchestration.config import ConfigError, RunSchema

    known = None
    recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), None) or "NAME"
    for i, item in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        key = None
        if item.startswith("-"):
            name = item.lstrip("-")
            if not name:
                continue
            if name.split("=", 1)[0] in ("config", "print-config", "print_config", "show-config", "show_config"):
                raise ConfigError(f"{item!r} is not an option of rlrepro train; --cfg prints the composed config")
            if name.split("=", 1)[0] == "cfg":  # --cfg=job: hydra's form, not this command's
                raise ConfigError(f"{item!r}: --cfg takes no value here; `rlrepro train recipe={recipe} --cfg` prints "
                                  "the composed config (every key)")
            if name.startswith("recipe"):  # --recipe NAME: _no_recipe_message names the form
                continue
            key, _, value = name.partition("=")
            if not value and nxt is not None and "=" not in nxt and not nxt.startswith("-"):
                value = nxt
        elif "=" not in item and nxt == "=":  # train.steps = 3 (three shell words)
            key, value = item, (args[i + 2] if i + 2 < len(args) else "")
        elif "=" in item and item.split("=", 1)[0] != item.split("=", 1)[0].rstrip():  # 'train.steps = 3'
            key, value = item.split("=", 1)[0].strip(), item.split("=", 1)[1].strip()
        elif "=" not in item and "." in item and nxt is not None and "=" not in nxt and not nxt.startswith("-"):
            key, value = item, nxt  # train.steps 3
        if key is None:
            continue
        if known is None:
            schema = OmegaConf.structured(RunSchema)
            known = _all_keys(schema)
        keys = [key]
        alias = _FOREIGN_KEYS.get(key) or _FOREIGN_KEYS.get(key.rsplit(".", 1)[-1])  # verl's spelling, as below
        if key not in known and alias in known:
            keys = [alias]
        elif key not in known:  # every key of that last name (train.* and rollout.* first), else the closest name
            first = ("train.", "rollout.", "run.", "data.")
            keys = sorted((k for k in known if k.endswith("." + key)),
                          key=lambda k: (next((i for i, f in enumerate(first) if k.startswith(f)), 9), k))
            keys = keys or difflib.get_close_matches(key, known, n=1)
            if not keys:
                raise ConfigError(f"{item!r} is not an option of rlrepro train (its only options are --cfg and --help) "
                                  "nor a config key; set config keys as one KEY=VALUE word each, e.g. train.steps=3. "
                                  f"`rlrepro train recipe={recipe} --cfg` prints every key")
        forms = [f"{k}={value or _flag_value(schema, k)}" for k in keys]
        which = forms[0] if len(forms) == 1 else "one of " + ", ".join(forms)
        raise ConfigError(f"{item!r}: rlrepro train takes config keys as one KEY=VALUE word each, no dashes and no "
                          f"spaces around '=' (its only options are --cfg and --help): {which}. "
                          f"`rlrepro train recipe={recipe} --cfg` prints every key")


def _flag_value(schema, key: str) -> str:
    """The value a bare ``--KEY`` most likely meant: ``true`` for a boolean key, else ``VALUE``."""
    from omegaconf import OmegaConf

    return "true" if isinstance(OmegaConf.select(schema, key), bool) else "VALUE"


def _no_recipe_message(overrides: list[str], available: list[str]) -> str:
    """No ``recipe=NAME``: when the recipe was named in another form (``grpo_tiny``, ``recipe grpo_tiny``,
    ``--recipe grpo_tiny``, ``--recipe=grpo_tiny``), say which one and the form to use."""
    words = [o.lstrip("-") for o in overrides]
    named = [w.split("=", 1)[1] if w.startswith("recipe=") else w for w in words
             if w.startswith("recipe=") or ("=" not in w and w != "recipe")]
    for name in named:
        close = difflib.get_close_matches(name.lower(), available, n=1)
        if close:
            return (f"name the recipe as recipe=NAME, not {' '.join(overrides)!r}: "
                    f"rlrepro train recipe={close[0]} ...; available: {', '.join(available)}")
    return f"name a recipe: rlrepro train recipe=NAME ...; available: {', '.join(available)}"


def _check_override_grammar(overrides: list[str], recipe: str) -> None:
    """Parse each override as hydra will; one its grammar refuses (a space-free value with a character outside
    it: ``run.dir=runs/ünï``, ``run.dir=~/runs``, ``data.template=q: {prompt}=``) fails naming it and its quoted
    form, which hydra takes as a plain string, instead of hydra's bare lexer message about the whole line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from rlrepro.orchestration.config import ConfigError

    parser = OverridesParser.create()
    for item in overrides:
        try:
            parser.parse_override(item)
        except HydraException as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "=" not in item:
                raise ConfigError(f"bad override for recipe {recipe}: {item!r} is not KEY=VALUE ({why})") from None
            key, value = item.split("=", 1)
            quote = "'" if "'" not in value else '"' if '"' not in value else None
            fix = "quote the value for hydra"
            if value.startswith("~"):  # quoted, it would be a folder named "~": the shell must expand it
                fix = f"neither hydra nor rlrepro expands ~: let the shell do it, {key}=$HOME{value[1:]}"
            elif quote:
                outer = '"' if quote == "'" else "'"
                quoted = f"{key}={quote}{value}{quote}"
                fix += f": {quoted}" + (f" (on a shell command line in other quotes: {outer}{quoted}{outer})"
                                        if outer not in value else "")
            raise ConfigError(f"bad override for recipe {recipe}: {item!r}: hydra's override grammar does not take "
                              f"this value unquoted ({why}); {fix}") from None


def _unknown_key_hint(key: str, schema) -> str | None:
    """``'train.lrr' is not a config key (close: train.lr)``, or None for a key of the schema (or one inside a
    mapping-valued key such as model.tiny_overrides)."""
    from omegaconf import OmegaConf

    known = _all_keys(schema)
    if key in known or any(key.startswith(k + ".") and OmegaConf.get_type(OmegaConf.select(schema, k)) is dict
                           for k in known):
        return None
    alias = _FOREIGN_KEYS.get(key) or _FOREIGN_KEYS.get(key.rsplit(".", 1)[-1])
    if alias in known:
        return f"{key!r} is not a config key; rlrepro's name for it is {alias}"
    close = difflib.get_close_matches(key, known, n=3)
    return f"{key!r} is not a config key" + (f" (close: {', '.join(close)})" if close else "")


# verl / OpenRLHF spellings a user brings along (the full key, or its last part) -> rlrepro's key
_FOREIGN_KEYS = {
    "rollout.n": "rollout.group_size", "n_samples_per_prompt": "rollout.group_size",
    "train_batch_size": "rollout.prompts_per_step", "rollout_batch_size": "rollout.prompts_per_step",
    "max_prompt_length": "data.max_prompt_tokens", "max_response_length": "rollout.max_tokens",
    "total_training_steps": "train.steps", "n_gpus_per_node": "train.num_gpus",
    "adv_estimator": "train.advantage", "kl_coef": "train.kl_coef", "init_kl_coef": "train.kl_coef",
    "ppo_micro_batch_size_per_gpu": "train.micro_batch_size", "ppo_max_token_len_per_gpu": "train.micro_batch_tokens",
    "tensor_model_parallel_size": "train.tensor_parallel", "actor_learning_rate": "train.lr",
    "max_turns": "env.max_turns", "multi_turn.max_assistant_turns": "env.max_turns",
}


def _into_mapping(item: str, schema) -> str:
    """``env.kwargs.digits=3`` or ``env.kwargs={digits: 3}``: a key inside (or the whole of) a mapping-valued key
    (``env.kwargs``, ``data.synthetic.kwargs``, ``model.tiny_overrides``) as hydra's ``++`` override, which may add
    keys that the recipe's mapping does not have yet (a plain override may not: "Key 'digits' is not in struct")."""
    from omegaconf import OmegaConf

    if item.startswith(("+", "~")) or "=" not in item:
        return item
    key = item.split("=", 1)[0]
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        try:
            node = OmegaConf.select(schema, prefix)
        except Exception:  # noqa: BLE001 - not a schema path
            node = None
        if node is not None and OmegaConf.get_type(node) is dict:
            return "++" + item
    return item


def _refuse_added_keys(overrides: list[str], schema, recipe: str) -> None:
    """hydra's ``+key=value`` adds a key without asking the schema; refuse it unless the schema has the key.
    hydra's ``~key`` deletes a key: the schema then puts its own default back in silence (``~run`` would reset
    run.seed and run.device and write into ``runs/${recipe}``, unresolved); refuse it for a schema key (a key
    inside a mapping-valued key, ``~model.tiny_overrides.num_hidden_layers``, may go)."""
    from omegaconf import OmegaConf

    from rlrepro.orchestration.config import ConfigError

    known = _all_keys(schema)
    for item in overrides:
        if item.startswith("~"):
            key = item[1:].split("=", 1)[0]
            if key in known and not any(key.startswith(k + ".") and OmegaConf.get_type(OmegaConf.select(schema, k))
                                        is dict for k in known):
                raise ConfigError(f"bad override for recipe {recipe}: {item!r} would delete {key}, and the schema "
                                  "would put its default back in silence. Set the value you want instead (KEY=VALUE, "
                                  f"null where a key allows it); `rlrepro train recipe={recipe} --cfg` prints every "
                                  "key with its value")
            continue
        if not item.startswith("+"):
            continue
        hint = _unknown_key_hint(item.split("=", 1)[0].lstrip("+"), schema)
        if hint:
            raise ConfigError(f"bad override for recipe {recipe}: {item!r}: {hint}. `rlrepro train recipe={recipe} "
                              "--cfg` prints every key")


def _all_keys(cfg, prefix: str = "") -> list[str]:
    from omegaconf import DictConfig

    keys = []
    for k in cfg:
        v = cfg[k] if not isinstance(cfg, DictConfig) or not cfg._get_node(k)._is_missing() else None
        path = f"{prefix}{k}"
        keys.append(path)
        if isinstance(v, DictConfig):
            keys.extend(_all_keys(v, path + "."))
    return keys


TRAIN_HELP = """usage: rlrepro train recipe=NAME [key=value ...] [--cfg]

Run a recipe (a hydra config shipped with rlrepro); key=value overrides any of its keys, e.g.
  rlrepro train recipe=grpo_tiny run.dir=runs/b train.steps=20 rollout.num_workers=2
  rlrepro train recipe=grpo_tiny run.dir=runs/b run.resume=true     # continue from the newest checkpoint
--cfg prints the recipe's every key with its value (and the overrides applied) instead of running.
Exit 0 done, 1 a step failed, 2 bad input (nothing run), 130 interrupted (a checkpoint is kept).

recipes (rlrepro recipes):
{recipes}
Keys: README.md "Command line" and docs/ (TRAINER.md train.*, ENGINE.md rollout.*, DATA.md data.*, ENVS.md env.*)."""


def cmd_train(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from rlrepro.orchestration.config import ConfigError

    if "-h" in args or "--help" in args:
        names = list_recipes()
        width = max((len(n) for n in names), default=0)
        print(TRAIN_HELP.format(recipes="\n".join(f"  {n:<{width}}  {recipe_description(n)}".rstrip()
                                                   for n in names)))
        return 0
    show = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    try:
        cfg = compose_config(args)
    except ConfigError as e:
        print(f"rlrepro train: {e}", file=sys.stderr)
        return 2
    if show:
        print(OmegaConf.to_yaml(cfg))
        return 0
    from rlrepro.orchestration import run_training
    from rlrepro.orchestration.errors import RunFailed, RunInterrupted

    from rlrepro.orchestration.config import migrate_override

    # the keys this command line sets: what a resume may change (rlrepro.orchestration.resume)
    override_keys = [migrate_override(a, warn=False).lstrip("+~").split("=", 1)[0] for a in args if "=" in a]
    try:
        run_training(cfg, override_keys=override_keys)
    except RunInterrupted as e:
        # Ctrl-C or SIGTERM: the message names the checkpoint left and how to continue.
        print(f"rlrepro train: {e}", file=sys.stderr)
        return 130
    except RunFailed as e:
        # A step failed (a fault, not bad input): the message names the step, the cause and the checkpoint left.
        if os.environ.get("RLREPRO_DEBUG"):
            raise
        print(f"rlrepro train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rlrepro train: interrupted before the run started; nothing was recorded", file=sys.stderr)
        return 130
    except (ConfigError, ValueError, FileNotFoundError) as e:
        # Bad input found while preparing the run (a data row, a model directory): the message names it, in one
        # line as a composition error prints (no class name: it is the user's input, not a crash)
        if os.environ.get("RLREPRO_DEBUG"):
            raise
        print(f"rlrepro train: {str(e) or type(e).__name__}", file=sys.stderr)
        return 2
    except OSError as e:
        # The machine refused something while preparing the run (a folder it cannot write, a cluster it cannot
        # reach): the path or address is in the message; a step's OSError arrives as RunFailed above.
        if os.environ.get("RLREPRO_DEBUG"):
            raise
        print(f"rlrepro train: the run could not be set up: {type(e).__name__}: {e} (RLREPRO_DEBUG=1 shows the "
              "traceback)", file=sys.stderr)
        return 2
    print(f"run written to {cfg.run.dir}", file=sys.stderr)
    return 0


def cmd_generate(args: list[str]) -> int:
    """``rlrepro generate`` (rlrepro.orchestration.generate_cmd)."""
    from rlrepro.orchestration.generate_cmd import main_generate

    return main_generate(args)


# the commands that compute rewards (a run, its re-execution, a checkpoint's evaluation): their scores must not
# depend on the string hash seed (see _pin_hash_seed)
HASH_SEED_COMMANDS = ("train", "verify", "eval")


def _pin_hash_seed(argv: list[str]) -> None:
    """Re-run the command with PYTHONHASHSEED=0 unless it is pinned already: sympy (inside math-verify) iterates
    sets, whose order follows the string hash seed, and a reward must not depend on it. Only the console
    entry point does this (``main(None)``); callers passing argv keep their process.

    The new interpreter runs with ``-P`` (no script directory or working directory put first on ``sys.path``; a
    ``python -m`` would put the working directory there, and a ``difflib.py`` in it would replace the standard
    library's). The working directory is searched last instead, in both processes, so a module found only there
    (a ``reward.fn`` module next to the data) still imports, and none there can shadow an installed one."""
    cwd = os.path.abspath(os.getcwd())
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != cwd] + [cwd]
    if os.environ.get("PYTHONHASHSEED") == "0" or os.environ.get("RLREPRO_NO_REEXEC"):
        return
    env = dict(os.environ, PYTHONHASHSEED="0")
    reexec = "import sys; from rlrepro.cli import main; sys.exit(main())"
    os.execve(sys.executable, [sys.executable, "-P", "-c", reexec, *argv], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] in ([c] for c in HASH_SEED_COMMANDS):
        _pin_hash_seed(sys.argv[1:])
    argv = list(sys.argv[1:] if argv is None else argv)
    if float(os.environ.get("RLREPRO_STACK_DUMP_S", "0") or 0) > 0:  # debugging a hang (actors do the same)
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["RLREPRO_STACK_DUMP_S"]), repeat=True)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return cmd_train(rest)
    if cmd == "diff":
        from rlrepro.repro.diff import main_diff

        return main_diff(rest)
    if cmd == "verify":
        from rlrepro.orchestration.verify import main_verify

        return main_verify(rest)
    if cmd == "plot":
        from rlrepro.repro.plot import main_plot

        return main_plot(rest)
    if cmd == "show":
        from rlrepro.repro.show import main_show

        return main_show(rest)
    if cmd == "generate":
        return cmd_generate(rest)
    if cmd == "recipes":
        if rest and rest[0] in ("-h", "--help"):
            print("usage: rlrepro recipes\n\nList the shipped recipes, one line each.")
            return 0
        if rest:
            print(f"rlrepro recipes: takes no arguments, got {' '.join(rest)!r}; "
                  f"run one with: rlrepro train recipe=NAME", file=sys.stderr)
            return 2
        return cmd_recipes()
    if cmd == "export":
        from rlrepro.orchestration.export import main_export

        return main_export(rest)
    if cmd == "eval":
        from rlrepro.orchestration.evaluation import main_eval

        return main_eval(rest)
    commands = ["train", "diff", "verify", "show", "plot", "generate", "export", "eval", "recipes"]
    close = difflib.get_close_matches(cmd.lower(), commands, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    print(f"rlrepro: unknown command {cmd!r}{hint}; commands: {', '.join(commands)} (rlrepro --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
