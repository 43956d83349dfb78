"""The application shell: CLI, local cluster and `specd up`, bench, distill."""
