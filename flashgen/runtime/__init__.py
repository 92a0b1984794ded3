"""The attention runtime: input checks, the winners table and its lookup, launches, autograd,
the torch.library op and the public calls. It imports only torch, triton and the standard
library, because `flashgen export` copies these files, byte for byte, into packages that run
without flashgen; flashgen plugs in its databases and renderer (`flashgen.serve`)."""
