"""``kernels.sanitizer``'s reading of a compute-sanitizer log: driver entry-point probes (cuda-python's lazy
cuGetProcAddress lookups, seen on the H200 host with driver 580.159) are host API return codes and are
tolerated and recorded; every other error, kernel memory errors and other API errors alike, counts."""

from verify.checks.kernels import _SUMMARY, classify_sanitizer_errors

PROBE = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to '
         'cuGetProcAddress_v2.\n=========     Saved host backtrace up to driver entry point at error\n')
OOB = ("========= Invalid __global__ read of size 4 bytes\n=========     at kernel_0x1+0x90\n"
       "=========     Address 0x7f00 is out of bounds\n")
OTHER_API = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to '
             'cuMemcpyAsync.\n')


def _errors(log: str) -> int:
    m = _SUMMARY.findall(log)
    return int(next(g for g in m[-1] if g))


def test_probes_are_tolerated_and_recorded():
    log = PROBE * 34 + "========= ERROR SUMMARY: 34 errors\n"
    assert classify_sanitizer_errors(log, _errors(log)) == (0, {"CUDA_ERROR_INVALID_VALUE on cuGetProcAddress_v2": 34})


def test_kernel_and_other_api_errors_still_count():
    log = PROBE * 3 + OOB + OTHER_API + "========= ERROR SUMMARY: 5 errors\n"
    errors, tolerated = classify_sanitizer_errors(log, _errors(log))
    assert errors == 2 and sum(tolerated.values()) == 3
