"""Developer tools beside the package (sm_90a compile reports and checks), not installed."""


def kernel_arg(kernel, args, name):
    """The value of ``kernel``'s parameter ``name`` in the argument list ``args`` of one of the
    Hopper ``kernel_args`` builders (tests and the compile check read arguments by name, never
    by position)."""
    assert len(args) == len(kernel.arg_names), (len(args), kernel.arg_names)
    return args[kernel.arg_names.index(name)]
