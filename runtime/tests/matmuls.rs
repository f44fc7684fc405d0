//! Several matrices on one input (`matmul_many`, the projections that share a layer's input) give each
//! matrix's own `matmul` result, with the exact kernels (the int8 ones: `q8_kernels.rs`).

mod common;

#[test]
fn matmul_many_equals_each_matrix_alone_with_the_exact_kernels() {
    common::assert_matmul_many_equals_each_alone();
}

#[test]
fn a_long_prompt_in_token_blocks_equals_its_tokens_alone_with_the_exact_kernels() {
    common::assert_long_prompts_equal_their_tokens_alone();
}
