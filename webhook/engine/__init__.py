"""The pure decision engine (argv, images, kinds, rules, verdicts, policy, signing): no I/O."""
