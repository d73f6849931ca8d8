"""Mutation testing of the core modules with mutmut, one module group at a time (``make mutate``).

mutmut 3 changes one operator, constant or argument at a time inside a function and reruns the tests that execute
that function; a mutant the tests still pass on has "survived". Each group mutates a few modules against the fast
test files that exercise them (mutmut picks, per mutant, the tests that cover the mutated function). Groups run in
scratch copies of the repository (``--work``), so their mutmut caches stay apart and the checkout is untouched.

    python tools/mutate.py [--groups field,solve] [--sample 7] [--budget-minutes 40] [--jobs 1] [--out mutation.md]
    python tools/mutate.py --report --work mutants-work     # the table of the recorded results, nothing run

``--sample D`` tests the mutants whose number ends in the digit ``D`` (mutmut numbers each function's mutants
1, 2, ...): a systematic 10% sample that spreads over every function; ``--sample all`` tests every mutant.

Prints, per module: mutants, killed (including timeouts), of which timeouts, survived, not covered by the selected
tests, not tested (errors), not yet run (the budget ran out), the score killed / (killed + survived + not covered +
errors), and the names of the mutants not killed (``mutmut show NAME`` in the group's scratch copy prints the diff).
mutmut 3.8's fork server files a mutant as "timeout" when pytest could not even run its tests (the worker's exit
code 255, e.g. pytest's usage error for a test id that no longer collects); such a mutant was never tested, so it is
counted here as an error, not a kill.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELD_TESTS = [
    "tests/energy/test_neurons.py",
    "tests/energy/test_energies.py",
    "tests/energy/test_model.py",
    "tests/dynamics/test_field.py",
    "tests/kernels/test_fused.py",
    "tests/kernels/test_fused_heads.py",
    "tests/energy/test_input_checks.py",
    "tests/energy/test_graph_attention.py",
    "tests/energy/test_exact_values.py",
    "tests/solving/test_fd_gradients.py::test_field_matches_the_spec_at_non_default_settings",
    "tests/solving/test_fd_gradients.py::test_field_and_its_backward_match_the_spec",
    "tests/solving/test_fd_gradients.py::test_solve_follows_the_spec_dynamics_at_two_time_constants",
    "tests/solving/test_counts_failures_and_settings.py",
    "-k",
    "not small_euler_steps and not solve_and_adjoint",
]
SOLVE_TESTS = [
    "tests/solving/test_solve.py",
    "tests/solving/test_solve_settings.py",
    "tests/energy/test_exact_values.py",
    "tests/solving/test_fd_gradients.py::test_steady_state_stop_gradient_of_the_initial_state",
    "tests/solving/test_fd_gradients.py::test_steady_state_stop_gradient_of_the_parameters",
    "tests/solving/test_steady_state_gradients.py",
    "tests/solving/test_gradients.py::test_gradcheck_through_the_solve",
    "tests/solving/test_gradients.py::test_implicit_needs_a_converged_solve",
    "tests/solving/test_counts_failures_and_settings.py",
    "-k",
    "not adaptive_solve_agrees and not adaptive_heun and not dopri8 and not adams and not per_sample_stopping_matches",
]
ATTRACTOR_TESTS = [
    "tests/energy/test_exact_values.py",
    "tests/equilibrium/test_attractor.py::test_the_convex_one_token_attractor_is_a_fixed_point_in_x",
    "tests/equilibrium/test_attractor.py::test_implicit_gradient_at_a_fixed_point_in_x_equals_finite_differences",
    "tests/solving/test_fd_gradients.py::test_implicit_gradient_matches_finite_differences_of_the_attractor_map",
    "tests/solving/test_gradients.py::test_implicit_equals_direct_through_a_long_converged_solve",
    "tests/solving/test_gradients.py::test_implicit_needs_a_converged_solve",
    "tests/solving/test_counts_failures_and_settings.py",
]
ENERGY_TESTS = [
    "tests/energy/test_neurons.py",
    "tests/energy/test_energies.py",
    "tests/energy/test_graph_attention.py",
    "tests/energy/test_exact_values.py",
    "tests/solving/test_fd_gradients.py::test_field_matches_the_spec_at_non_default_settings",
    "tests/solving/test_fd_gradients.py::test_field_and_its_backward_match_the_spec",
    "tests/solving/test_counts_failures_and_settings.py",
]
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "energies": (["et_ode/energy/neurons.py", "et_ode/energy/energies.py"], ENERGY_TESTS),
    "field": (
        [
            "et_ode/energy/model.py",
            "et_ode/energy/checks.py",
            "et_ode/energy/masks.py",
            "et_ode/dynamics/field.py",
            "et_ode/kernels/fused.py",
            "et_ode/kernels/gemm.py",
        ],
        FIELD_TESTS,
    ),
    "attractor": (["et_ode/dynamics/manifold.py", "et_ode/equilibrium/implicit.py"], ATTRACTOR_TESTS),
    "solve": (
        [
            "et_ode/solving/solve.py",
            "et_ode/integrators/loop.py",
            "et_ode/integrators/solvers.py",
            "et_ode/integrators/stopping.py",
            "et_ode/solving/gradients.py",
        ],
        SOLVE_TESTS,
    ),
}
KILLED = {"killed", "timeout", "caught by type check"}
HARNESS_ERROR = 255  # the fork server's code for "running the tests raised": nothing was tested


def scratch_copy(work: Path, group: str, modules: list[str], tests: list[str]) -> Path:
    """A copy of the tracked and untracked (not ignored) files, with a setup.cfg naming this group's modules."""
    target = work / group
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in files:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    # mutmut's default timeout (15x a mutant's clean test time in CPU, half that in wall time): 3x gave false
    # timeouts on the loaded shared machine (equivalent mutants filed as killed)
    lines = [
        "[mutmut]",
        "source_paths = et_ode/",
        "process_isolation = forkserver",
        "only_mutate =",
        *(f"    {m}" for m in modules),
        "pytest_add_cli_args_test_selection =",
        *(f"    {t}" for t in tests),
    ]
    (target / "setup.cfg").write_text("\n".join(lines) + "\n")
    return target


def results(folder: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=folder, capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"^\s*(\S+): (.+)$", out, flags=re.M))


def exit_codes(folder: Path) -> dict[str, int | None]:
    """Each mutant's recorded worker exit code, from mutmut's ``.meta`` files."""
    codes: dict[str, int | None] = {}
    for meta in (folder / "mutants").rglob("*.meta"):
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    parser.add_argument("--sample", default="7", help="a digit (10%% systematic sample) or 'all'")
    parser.add_argument("--budget-minutes", type=float, default=40.0, help="wall-clock budget for all groups")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once (mutmut --max-children)")
    parser.add_argument("--work", type=Path, default=ROOT / "mutants-work", help="scratch folder (kept for mutmut show)")
    parser.add_argument("--out", type=Path, help="also write the summary (markdown) here")
    parser.add_argument("--report", action="store_true", help="only summarise the scratch copies' recorded results")
    args = parser.parse_args()
    groups = [g for g in args.groups.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown groups {unknown}; choose from {list(GROUPS)}")
    if args.sample != "all" and not (len(args.sample) == 1 and args.sample.isdigit()):
        parser.error(f"--sample must be a digit or 'all', got {args.sample!r}")
    pattern = [] if args.sample == "all" else [f"*__mutmut_*{args.sample}"]
    deadline = time.monotonic() + 60 * args.budget_minutes
    table = [
        "| module | mutants | killed | of which timeouts | survived | not covered | not tested (error) | not run | score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    survivors: list[str] = []
    for index, group in enumerate(groups):
        modules, tests = GROUPS[group]
        folder = args.work / group
        if not args.report:
            folder = scratch_copy(args.work, group, modules, tests)
            share = (deadline - time.monotonic()) / (len(groups) - index)
            print(f"[mutate] group {group}: {len(modules)} modules, up to {share / 60:.1f} min", flush=True)
            try:
                subprocess.run(
                    [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs), *pattern],
                    cwd=folder,
                    timeout=max(share, 60),
                    stdout=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                print(f"[mutate] group {group}: budget spent; scoring the mutants run so far", flush=True)
        by_module: dict[str, Counter] = defaultdict(Counter)
        codes = exit_codes(folder)
        for name, status in results(folder).items():
            if pattern and not name.endswith(args.sample):
                continue
            module = re.split(r"\.x[_\u01c1]", name)[0]
            kind = (
                "error"
                if codes.get(name) == HARNESS_ERROR
                else "killed"
                if status in KILLED
                else "survived"
                if status == "survived"
                else "not covered"
                if status == "no tests"
                else "not run"
            )
            by_module[module][kind] += 1
            by_module[module]["timeout"] += kind == "killed" and status == "timeout"
            if kind in ("survived", "not covered", "error"):
                survivors.append(f"{group}: {name} ({'not tested: harness error' if kind == 'error' else status})")
        for module, counts in sorted(by_module.items()):
            scored = counts["killed"] + counts["survived"] + counts["not covered"] + counts["error"]
            score = f"{100 * counts['killed'] / scored:.1f}%" if scored else "-"
            total = sum(counts[k] for k in ("killed", "survived", "not covered", "error", "not run"))
            table.append(
                f"| {module} | {total} | {counts['killed']} | {counts['timeout']} | {counts['survived']} | "
                f"{counts['not covered']} | {counts['error']} | {counts['not run']} | {score} |"
            )
    summary = "\n".join(table + ["", "Surviving / not covered mutants:", *survivors])
    print(summary)
    if args.out:
        args.out.write_text(summary + "\n")


if __name__ == "__main__":
    main()
