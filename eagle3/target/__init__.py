"""The target model, which speculative decoding verifies drafts with: loading it, rendering text
the way it reads it, capturing its hidden states, and proving that capture right (patch-check).

Named `target` as the params (`target`, `target.trust_remote_code`) and the code (`Target`,
`load_target`) name it. Build tools call their output folder `target/` too (Maven, Cargo), and a
global gitignore may hold that name: the repository's .gitignore un-ignores this folder."""
