"""The math reward's cost rule (rlrepro/data/math_cost.py): normal answers score exactly as before it, what it
refuses is refused deterministically, and math-verify's own functions are untouched outside it."""
import logging
import threading

import pytest

from rlrepro.data import MathReward, PromptRecord, math_reward
from rlrepro.data.math_cost import TooCostly, check_latex, check_parsed, parse_guarded


def B(answer):
    return "so the answer is \\boxed{" + answer + "}."


def rec(answer, uid="u:0"):
    return PromptRecord(uid=uid, prompt="q", answer=answer)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# (completion, gold answer, reward): computed with the math reward as it was before the cost rule (commit 4e788cf),
# integers, fractions, radicals, pi, expressions, equations, intervals, sets, tuples, matrices, percentages, text
NORMAL = [
    (B('42'), '42', 1.0),
    (B('41'), '42', 0.0),
    (B('-7'), '-7', 1.0),
    (B('7'), '-7', 0.0),
    (B('0'), '0', 1.0),
    (B('1,000'), '1000', 1.0),
    (B('1000'), '1,000', 1.0),
    (B('10^{6}'), '1000000', 1.0),
    (B('2^{10}'), '1024', 1.0),
    (B('3.0'), '3', 1.0),
    (B('3.14'), '3.14', 1.0),
    (B('3.14159'), r'\pi', 0.0),
    (B(r'\pi'), r'\pi', 1.0),
    (B(r'2\pi'), r'2\pi', 1.0),
    (B(r'\frac{\pi}{2}'), r'\frac{\pi}{2}', 1.0),
    (B(r'\pi/2'), r'\frac{\pi}{2}', 1.0),
    (B(r'90^\circ'), '90', 1.0),
    (B('90'), r'90^\circ', 1.0),
    (B(r'\frac{1}{2}'), r'\frac{1}{2}', 1.0),
    (B(r'\dfrac{1}{2}'), r'\frac{1}{2}', 1.0),
    (B(r'\tfrac12'), r'\frac{1}{2}', 1.0),
    (B('0.5'), r'\frac12', 1.0),
    (B(r'\frac{2}{3}'), r'\frac{3}{2}', 0.0),
    (B(r'-\frac{3}{4}'), r'-\frac{3}{4}', 1.0),
    (B(r'\frac{-3}{4}'), r'-\frac{3}{4}', 1.0),
    (B('0.75'), r'\frac{3}{4}', 1.0),
    (B('0.333'), r'\frac{1}{3}', 0.0),
    (B('0.3333333'), r'\frac{1}{3}', 1.0),
    (B(r'\frac{22}{7}'), r'\pi', 0.0),
    (B(r'\sqrt{2}'), r'\sqrt{2}', 1.0),
    (B(r'\sqrt{8}'), r'2\sqrt{2}', 1.0),
    (B(r'2\sqrt{2}'), r'\sqrt{8}', 1.0),
    (B(r'\frac{\sqrt{3}}{2}'), r'\frac{\sqrt3}{2}', 1.0),
    (B(r'\frac{1}{\sqrt{2}}'), r'\frac{\sqrt{2}}{2}', 1.0),
    (B(r'\sqrt[3]{27}'), '3', 1.0),
    (B(r'3\sqrt{5}'), r'\sqrt{45}', 1.0),
    (B(r'\sqrt{5}'), r'\sqrt{6}', 0.0),
    (B(r'1+\sqrt{2}'), r'\sqrt{2}+1', 1.0),
    (B(r'\frac{1+\sqrt{5}}{2}'), r'\frac{1+\sqrt5}{2}', 1.0),
    (B('x+1'), '1+x', 1.0),
    (B('x^2+2x+1'), '(x+1)^2', 1.0),
    (B('(x+1)^2'), 'x^2+2x+1', 1.0),
    (B('2x'), 'x+x', 1.0),
    (B('x^2-1'), '(x-1)(x+1)', 1.0),
    (B(r'\frac{x}{2}'), '0.5x', 1.0),
    (B('3x-2'), '3x+2', 0.0),
    (B('a+b'), 'b+a', 1.0),
    (B(r'\sin^2 x + \cos^2 x'), '1', 1.0),
    (B('e^{2}'), 'e^2', 1.0),
    (B(r'\ln 2'), r'\log 2', 0.0),
    (B(r'\log_2 8'), '3', 1.0),
    (B('x=2'), '2', 1.0),
    (B('2'), 'x=2', 1.0),
    (B('x=2'), 'x=2', 1.0),
    (B('y=2x+1'), 'y=2x+1', 1.0),
    (B('y = 1 + 2x'), 'y=2x+1', 1.0),
    (B('[1,2]'), '[1,2]', 1.0),
    (B('(1,2)'), '(1,2)', 1.0),
    (B('[1,2)'), '[1,2)', 1.0),
    (B('(1,2]'), '[1,2]', 0.0),
    (B(r'(-\infty, 3)'), r'(-\infty,3)', 1.0),
    (B(r'(-\infty,3]'), r'(-\infty,3)', 0.0),
    (B(r'[0,1]\cup[2,3]'), r'[0,1]\cup[2,3]', 1.0),
    (B('x<3'), r'(-\infty,3)', 0.0),
    (B(r'x \le 3'), r'(-\infty,3]', 0.0),
    (B(r'\{1,2,3\}'), r'\{3,2,1\}', 1.0),
    (B('1,2,3'), '1,2,3', 1.0),
    (B('3,2,1'), '1,2,3', 1.0),
    (B('(3,4)'), '(3, 4)', 1.0),
    (B(r'\infty'), r'\infty', 1.0),
    (B(r'\emptyset'), r'\emptyset', 1.0),
    (B('3+4i'), '3+4i', 1.0),
    (B('4i+3'), '3+4i', 1.0),
    (B(r'50\%'), '50', 1.0),
    (B('50'), r'50\%', 1.0),
    (B('0.5'), r'50\%', 0.0),
    (B(r'\$5'), '5', 1.0),
    (B('5'), r'\$5.00', 1.0),
    (B(r'\text{(A)}'), r'\text{(A)}', 1.0),
    (B('A'), 'A', 1.0),
    (B('B'), 'A', 0.0),
    (B(r'\text{yes}'), r'\text{yes}', 1.0),
    (B('1011_2'), '1011_2', 1.0),
    (B(r'\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}'), r'\begin{pmatrix}1&2\\3&4\end{pmatrix}', 1.0),
    (B(r'\begin{pmatrix} 1 \\ 2 \end{pmatrix}'), r'\begin{pmatrix} 1 \\ 3 \end{pmatrix}', 0.0),
    (B(r'1.5\times 10^{3}'), '1500', 1.0),
    (B(r'6.02\times10^{23}'), r'6.02 \times 10^{23}', 1.0),
    (B(r'\binom{5}{2}'), '10', 1.0),
    (B('5!'), '120', 1.0),
    (B('10!'), '3628800', 1.0),
    (B(r'\frac{10!}{8!}'), '90', 1.0),
    (B('12345678901234567890'), '12345678901234567890', 1.0),
    (B('2^{100}'), '1267650600228229401496703205376', 1.0),
    (B(r'\left( \frac{1}{2}, \frac{\sqrt{3}}{2} \right)'), r'\left(\frac12,\frac{\sqrt3}2\right)', 1.0),
    (B('|x|'), '|x|', 1.0),
    (B(r'\lfloor 3.7 \rfloor'), '3', 1.0),
    (B(r'\frac{a}{b}'), r'\frac{a}{b}', 1.0),
    ('The final answer is 42.', '42', 1.0),
    ('The final answer is $\\frac{1}{2}$.', '0.5', 1.0),
    ('Therefore the answer is 7', '7', 1.0),
    ('We get 3 and then 5', '5', 1.0),
    ("I don't know", '4', 0.0),
    ('', '4', 0.0),
    ('\\boxed{4', '4', 0.0),
    ('so the answer is \\boxed{4}. and also \\boxed{5}', '5', 1.0),
]

# (completion, gold, reward before the rule, reward now): sums, products, integrals, limits and derivatives are
# never evaluated now (an unbounded computation); an answer holding one scores 0.0, even a small one
CHANGED = [
    (B(r'\sum_{k=1}^{5} k'), '15', 1.0, 0.0),
    (B(r'\prod_{k=1}^{4} k'), '24', 1.0, 0.0),
    (B(r'\int_0^1 x\,dx'), r'\frac12', 1.0, 0.0),
    (B(r'\lim_{x\to 0} \frac{\sin x}{x}'), '1', 1.0, 0.0),
    (B(r'\frac{d}{dx} x^2'), '2x', 1.0, 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", NORMAL)
def test_normal_answers_score_exactly_as_before(completion, answer, expected):
    assert math_reward(completion, rec(answer)) == expected


@pytest.mark.parametrize("completion,answer,before,now", CHANGED)
def test_unevaluated_operators_score_zero(completion, answer, before, now):
    assert before == 1.0
    assert math_reward(completion, rec(answer)) == now


@pytest.mark.parametrize("text,reason", [
    (r"\int_0^1 x\,dx", r"\\int is never evaluated"),
    (r"\sum_{n=1}^{10^{7}} \frac{1}{n}", r"\\sum is never evaluated"),
    (r"\lim_{x\to 0} x", r"\\lim is never evaluated"),
    (r"\det\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\\det is never evaluated"),
    (r"\begin{vmatrix}1&2\\3&4\end{vmatrix}", "is never evaluated"),
    (r"\operatorname{eye}(100000)", "is never evaluated"),
    (r"\gcd(12, 18)", "is never evaluated"),
    (r"\left. x^{x} \right|_{x=10^{10}}", "is never evaluated"),
    ("{" * 7 + "x" + "}" * 7, "brackets nested 7 deep > max_latex_depth=6"),
    ("|x|" * 9, r"structure weight 72 > max_latex_weight=48"),
    (r"x^{x^{x^{x^{x}}}}+x^{x^{x^{x^{x}}}}", "structure weight 60 > max_latex_weight=48"),
    (r"\binom{1000000000}{100000}", "a binomial or Gamma with a literal of more than 4 digits"),
    (r"\Gamma(10000000)", "a binomial or Gamma with a literal of more than 4 digits"),
    ("1" * 257, "longer than max_answer_chars=256"),
])
def test_the_latex_rule_refuses(text, reason):
    with pytest.raises(TooCostly, match=reason):
        check_latex(text, MathReward())
    assert math_reward(rf"\boxed{{{text}}}", rec("1")) == 0.0


@pytest.mark.parametrize("text,weight", [
    ("42", 0), (r"\frac{1}{2}", 2), (r"|x|^{2}", 11), (r"\left|x\right|^{2}", 4), (r"x^{4}-4x^{3}y+6x^{2}y^{2}", 12),
    (r"\left( \frac{1}{2}, \frac{\sqrt{3}}{2} \right)", 12), (r"\binom{10}{3}", 2), (r"\Gamma(5)", 1),
])
def test_the_latex_rule_admits_normal_answers(text, weight):
    assert check_latex(text, MathReward()) == weight


@pytest.mark.parametrize("text,reason", [
    (r"\frac{d}{dx} x^{2}", "Derivative is never evaluated"),
    (r"9^{9^{9}}", r"a number above 2\^65536"),
    (r"[9^{9^{9^{9}}}, 1]", r"a number above 2\^65536"),             # latex2sympy compares interval ends
    (r"[(10^{7})!!, (10^{7})!]", "factorial of an argument above max_function_arg=1000"),
    (r"(x+1)^{128}", "expands to more than max_expansion_terms=128 terms"),
    (r"\frac{1}{(x+1)^{16}}", "expands to more than max_expansion_terms=128 terms"),  # 17 terms, counted 8 times
    (r"(\sin x + \cos y)^{8}", "more than max_function_factors=16 function factors"),  # 9 terms, 2 each
    (r"\sin(64x)", "more than max_function_factors=16 function factors"),
    (r"\sinh(16)", "more than max_function_factors=16 function factors"),
    (r"x = (x+1)^{9}", "an equation or inequality of degree above max_degree=8"),
    (r"\frac{k^{5}}{b^{5}} \sin(16)", "degree above max_degree=8 beside a function"),
    ("-x" * 120, "more than max_nodes=200 nodes"),
])
def test_the_expression_rule_refuses(text, reason):
    with pytest.raises(TooCostly, match=reason):
        check_parsed(parse_guarded(f"${text}$", MathReward()), MathReward())
    assert math_reward(rf"\boxed{{{text}}}", rec("1")) == 0.0


def test_a_gold_answer_outside_the_rule_is_a_data_error():
    with pytest.raises(ValueError, match=r"the gold answer '\\\\int_0\^1 x dx' of record 'u:0' exceeds the "
                                         r"deterministic limits \(\\int is never evaluated\)"):
        math_reward(B("1"), rec(r"\int_0^1 x dx"))
    # a gold answer is data: its length is not limited, a completion's is
    long = r"\{" + ",".join(str(i) for i in range(1, 100)) + r"\}"
    assert len(long) > 256
    assert math_reward(B(long), rec(long)) == 0.0
    assert MathReward(max_answer_chars=400)(B(long), rec(long)) == 1.0


def test_math_verify_is_untouched_outside_the_rule():
    from math_verify import parse

    math_reward(B("1"), rec("1"))  # the hooks are installed by now
    det = r"$\det\begin{pmatrix}1&2\\3&4\end{pmatrix}$"
    assert parse(det, parsing_timeout=None)[0] == -2       # math-verify's own parse evaluates it (and caches it)
    assert math_reward(B(det[1:-1]), rec("-2")) == 0.0     # the cached parse does not bypass the rule
    assert str(parse(r"$\int_0^1 x\,dx$", parsing_timeout=None)[0].doit()) == "1/2"


def test_limits_are_per_instance_and_per_thread():
    strict, answer = MathReward(max_latex_weight=1), r"\frac{6}{2}"  # weight 2; the gold 3 weighs 0
    out = {}
    barrier = threading.Barrier(2)

    def score(key, reward):
        barrier.wait()
        out[key] = [reward(B(answer), rec("3")) for _ in range(3)]

    threads = [threading.Thread(target=score, args=("strict", strict)),
               threading.Thread(target=score, args=("default", math_reward))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {"strict": [0.0] * 3, "default": [1.0] * 3}
    with pytest.raises(ValueError, match="max_latex_weight must be a positive integer"):
        MathReward(max_latex_weight=0)
