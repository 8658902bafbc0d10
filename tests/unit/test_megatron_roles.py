"""`--megatron-config` role overrides, `--critic-load/--critic-save`, and the PPO flag rules: what each role's args
become, and the one-line errors for every mistake (raised by `parse_args`, i.e. before `ray.init`)."""

from __future__ import annotations

import pytest

from slime.arguments import parse_args
from slime.backends.megatron.roles import role_args
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("roles") / "model"))


@pytest.fixture
def run(hf_dir, tmp_path):
    def _run(yaml_text: str | None, *extra: str):
        flags = ["--hf-checkpoint", hf_dir, "--rollout-batch-size", "2", "--num-rollout", "1", "--colocate",
                 "--advantage-estimator", "ppo", *extra]  # fmt: skip
        if yaml_text is not None:
            path = tmp_path / "roles.yaml"
            path.write_text(yaml_text)
            flags += ["--megatron-config", str(path)]
        return parse_args(flags)

    return _run


def test_roles_get_their_overrides_and_inherit_the_rest(run, tmp_path):
    args = run(
        "megatron:\n"
        "  - name: default\n    role: actor\n    overrides: {lr: 1e-6, save: /ckpt/actor, lr-warmup-iters: 3}\n"
        "  - name: default\n    role: critic\n    args:\n      lr: 1e-5\n      load: /ckpt/critic\n"
        "      no_save_optim: true\n",
        "--lr", "3e-4", "--weight-decay", "0.05", "--save", "/ckpt/cli", "--kl-coef", "0.1",
    )  # fmt: skip
    actor, critic = role_args(args, "actor"), role_args(args, "critic")
    assert (actor.lr, actor.save, actor.lr_warmup_iters, actor.weight_decay) == (1e-6, "/ckpt/actor", 3, 0.05)
    assert isinstance(actor.lr, float) and isinstance(critic.lr, float)  # YAML's 1e-6 is a string: coerced
    assert (critic.lr, critic.load, critic.no_save_optim, critic.weight_decay) == (1e-5, "/ckpt/critic", True, 0.05)
    assert critic.save == "/ckpt/actor/critic"  # not in the file: critic/ under the actor's save dir
    assert actor.kl_coef == 0.1 and critic.kl_coef == 0.0  # the critic's returns are the task reward's
    assert args.lr == 3e-4 and args.save == "/ckpt/cli"  # the command line itself is left alone


def test_without_a_config_every_role_is_the_command_line(run):
    args = run(None, "--lr", "2e-6", "--save", "/s", "--load", "/l")
    actor, critic = role_args(args, "actor"), role_args(args, "critic")
    assert actor.lr == critic.lr == 2e-6
    assert (critic.save, critic.load) == ("/s/critic", "/l/critic")
    args = run(None, "--save", "/s", "--critic-save", "/c", "--critic-load", "/c")
    assert (role_args(args, "critic").save, role_args(args, "critic").load) == ("/c", "/c")


@pytest.mark.parametrize(
    ("text", "extra", "match"),
    [
        (
            "megatron:\n  - {role: actor, overrides: {lrr: 1}}\n",
            (),
            r"roles.yaml:2: .*lrr: unknown flag; did you mean 'lr'",
        ),
        (
            "megatron:\n  - {role: critic}\n  - {role: critic}\n",
            (),
            r":3: megatron\[1\].role: role 'critic' is listed twice",
        ),
        (
            "megatron:\n  - {role: critic, overrides: {tensor_model_parallel_size: 2}}\n",
            (),
            "parallel topology is shared by actor and critic",
        ),
        ("megatron:\n  - {role: actor, overrides: {sequence_parallel: true}}\n", (), "parallel topology"),
        ("megatron:\n  - {role: critic, overrides: {global_batch_size: 4}}\n", (), "applies to the whole run"),
        ("megatron:\n  - {role: actor, overrides: {hf_checkpoint: /x}}\n", (), "applies to the whole run"),
        ("megatron:\n  - {role: reward}\n", (), "is not a role"),
        ("megatron:\n  - {overrides: {lr: 1}}\n", (), "`role` is required"),
        ("megatron:\n  - {role: actor, overrides: {lr: fast}}\n", (), "cannot read 'fast' as float"),
        ("megatron:\n  - {role: actor, overrides: {lr_decay_style: sideways}}\n", (), "is not one of"),
        ("megatron:\n  - {role: actor, overrides: {bf16: maybe}}\n", (), "expected true or false"),
        ("critic: {lr: 1}\n", (), "unknown key"),
        ("megatron:\n  - {role: critic, overrides: {save: /a}}\n", ("--critic-save", "/b"), "disagree"),
    ],
)
def test_mistakes_are_one_line_before_anything_starts(run, text, extra, match):
    with pytest.raises(SlimeArgError, match=match) as e:
        run(text, *extra)
    assert "\n" not in str(e.value)


def test_critic_flags_need_ppo(hf_dir, tmp_path):
    base = ["--hf-checkpoint", hf_dir, "--rollout-batch-size", "2", "--num-rollout", "1", "--colocate"]
    with pytest.raises(SlimeArgError, match="--critic-save needs --advantage-estimator ppo"):
        parse_args([*base, "--critic-save", "/c"])
    with pytest.raises(SlimeArgError, match="--num-critic-only-steps needs --advantage-estimator ppo"):
        parse_args([*base, "--num-critic-only-steps", "2"])
    path = tmp_path / "c.yaml"
    path.write_text("megatron:\n  - {role: critic, overrides: {lr: 1}}\n")
    with pytest.raises(SlimeArgError, match="critic entry needs --advantage-estimator ppo"):
        parse_args([*base, "--megatron-config", str(path)])
    path.write_text("megatron:\n  - {role: actor, overrides: {lr: 1}}\n")
    assert role_args(parse_args([*base, "--megatron-config-path", str(path)]), "actor").lr == 1.0
    with pytest.raises(SlimeArgError, match="--lambd must lie in"):
        parse_args([*base, "--advantage-estimator", "ppo", "--lambd", "1.5"])
