"""The target model, the verifier of speculative decoding (named so that no tool takes the folder
for build output, as Maven's and Cargo's `target/`): loading it, rendering text the way it reads
it, capturing its hidden states, and proving that capture right (patch-check)."""
