"""The compiled block functions' names, which the compiler gives and the stages call by: one home for both."""
from __future__ import annotations


def block_function_name(part: str, phase: str, signature: int = 0) -> str:
    """The compiled function for `part` (pre_attn | post_attn) in `phase` (prefill | decode) of the blocks whose
    weights have type signature `signature` (ModelSpec.block_signatures(): one for unquantized models, two for a
    Q4_K_M file); the compiler names the functions with it and the stage calls them by it."""
    return f"{part}_{phase}" if signature == 0 else f"{part}_{phase}_t{signature}"


def batch_phase(batch: int) -> str:
    """The phase of the decode step of `batch` sequences, one token each: "decode" for one, else the batched
    decode variant "decode_b{batch}" (static rows: each row's result bit-identical to its own one-token decode,
    as the GEMVs are batch-invariant; import_relax makes the variants)."""
    return "decode" if batch == 1 else f"decode_b{batch}"


def moe_expert_sum_name(gate_type: str, down_type: str, experts: int, inter: int, hidden: int,
                        biased: bool = False) -> str:
    """The CPU library's one-call expert sum for one decode token of the blocks whose experts have (gate/up,
    down) types (gate_type, down_type) (schedules/cpu/quant/moe_experts.py); absent where those types have no
    int8 kernel on the target CPU. `biased`: gpt-oss's experts (biases, clamped SwiGLU), a kernel of more arguments."""
    return f"helmc_moe_expert_sum_{gate_type}_{down_type}_e{experts}_i{inter}_h{hidden}{'_biased' if biased else ''}"


def moe_expert_rows_name(gate_type: str, down_type: str, experts: int, inter: int, hidden: int,
                         biased: bool = False) -> str:
    """The CPU library's one-call expert sum for a batched decode step's m rows (schedules/cpu/quant/
    moe_experts_rows.py), beside moe_expert_sum_name's one-row kernel for the same blocks."""
    return f"helmc_moe_expert_rows_{gate_type}_{down_type}_e{experts}_i{inter}_h{hidden}{'_biased' if biased else ''}"


def gpu_moe_names(gate_type: str, down_type: str, experts: int, inter: int, hidden: int,
                  biased: bool = False) -> tuple[str, str]:
    """The GPU library's two decode expert kernels (gate_up, down) for the blocks whose experts have (gate/up, down)
    types (gate_type, down_type) (schedules/gpu/moe_experts.py); absent where those types have no int8 GPU kernel.
    `biased`: gpt-oss's experts (biases, clamped SwiGLU; schedules/gpu/moe_experts_biased.py), more arguments."""
    tail = f"e{experts}_i{inter}_h{hidden}{'_biased' if biased else ''}"
    return f"helmc_gpu_moe_gate_up_{gate_type}_{tail}", f"helmc_gpu_moe_down_{down_type}_{tail}"


def gpu_moe_rows_names(gate_type: str, down_type: str, experts: int, inter: int, hidden: int,
                       biased: bool = False) -> tuple[str, str]:
    """The GPU library's two decode expert kernels for a batched step's m rows (gate_up, down; schedules/gpu/
    moe_experts.py's make_gpu_moe_rows_kernels), beside gpu_moe_names' one-row pair for the same blocks."""
    tail = f"e{experts}_i{inter}_h{hidden}{'_biased' if biased else ''}"
    return f"helmc_gpu_moe_gate_up_rows_{gate_type}_{tail}", f"helmc_gpu_moe_down_rows_{down_type}_{tail}"
