"""Web application firewall: policy model, transforms, matchers (RE2, Aho-Corasick, libinjection), rule packs."""
