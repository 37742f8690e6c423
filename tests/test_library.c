/* SPDX-License-Identifier: MIT */
/*
 * test_library.c — what a user linking libkvrecall.so relies on: it needs no
 * CUDA library (cudart is static), exports only the kvr_ API, carries a
 * versioned SONAME, and loads and works through dlopen. The ELF file is read
 * directly, so the check needs no binutils.
 */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvrecall.h"

#ifndef KVR_LIB_PATH
#error "KVR_LIB_PATH must name the built libkvrecall.so"
#endif

struct elf_view {
	const unsigned char *base;
	size_t size;
	const Elf64_Shdr *dynsym, *dynstr, *dynamic;
};

static void elf_open(struct elf_view *v)
{
	int fd = open(KVR_LIB_PATH, O_RDONLY);
	cr_assert_geq(fd, 0, "cannot open %s", KVR_LIB_PATH);
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	v->size = (size_t)st.st_size;
	v->base = mmap(NULL, v->size, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	cr_assert_neq(v->base, MAP_FAILED);
	const Elf64_Ehdr *eh = (const Elf64_Ehdr *)v->base;
	cr_assert_eq(memcmp(eh->e_ident, ELFMAG, SELFMAG), 0);
	cr_assert_eq(eh->e_ident[EI_CLASS], ELFCLASS64);
	const Elf64_Shdr *sh = (const Elf64_Shdr *)(v->base + eh->e_shoff);
	v->dynsym = v->dynstr = v->dynamic = NULL;
	for (int i = 0; i < eh->e_shnum; i++) {
		if (sh[i].sh_type == SHT_DYNSYM) {
			v->dynsym = &sh[i];
			v->dynstr = &sh[sh[i].sh_link];
		}
		if (sh[i].sh_type == SHT_DYNAMIC)
			v->dynamic = &sh[i];
	}
	cr_assert_not_null(v->dynsym);
	cr_assert_not_null(v->dynamic);
}

Test(library, no_cuda_runtime_dependency)
{
	struct elf_view v;
	elf_open(&v);
	const Elf64_Dyn *dyn = (const Elf64_Dyn *)(v.base + v.dynamic->sh_offset);
	const char *strtab = (const char *)(v.base + v.dynstr->sh_offset);
	int found_soname = 0;
	for (size_t i = 0; i < v.dynamic->sh_size / sizeof(*dyn) && dyn[i].d_tag != DT_NULL; i++) {
		const char *name = strtab + dyn[i].d_un.d_val;
		if (dyn[i].d_tag == DT_NEEDED) {
			cr_log_info("NEEDED %s", name);
			cr_expect(strncmp(name, "libcudart", 9) != 0, "depends on %s", name);
			cr_expect(strncmp(name, "libcuda.", 8) != 0, "depends on %s", name);
			cr_expect(strstr(name, "cublas") == NULL, "depends on %s", name);
		}
		if (dyn[i].d_tag == DT_SONAME) {
			found_soname = 1;
			cr_expect_str_eq(name, "libkvrecall.so.0");
		}
	}
	cr_expect(found_soname, "no SONAME");
	munmap((void *)v.base, v.size);
}

Test(library, exports_only_the_api)
{
	struct elf_view v;
	elf_open(&v);
	const Elf64_Sym *sym = (const Elf64_Sym *)(v.base + v.dynsym->sh_offset);
	const char *strtab = (const char *)(v.base + v.dynstr->sh_offset);
	size_t n_api = 0;
	for (size_t i = 0; i < v.dynsym->sh_size / sizeof(*sym); i++) {
		if (sym[i].st_shndx == SHN_UNDEF || ELF64_ST_BIND(sym[i].st_info) == STB_LOCAL)
			continue;
		const char *name = strtab + sym[i].st_name;
		if (ELF64_ST_TYPE(sym[i].st_info) == STT_NOTYPE && !*name)
			continue;
		/* the version node itself is an absolute symbol */
		if (sym[i].st_shndx == SHN_ABS && !strcmp(name, "KVRECALL_0"))
			continue;
		cr_expect_eq(strncmp(name, "kvr_", 4), 0, "exports non-API symbol %s", name);
		n_api++;
	}
	cr_expect_geq(n_api, 10, "only %zu API symbols exported", n_api);
	munmap((void *)v.base, v.size);
}

Test(library, loads_and_works_through_dlopen)
{
	void *h = dlopen(KVR_LIB_PATH, RTLD_NOW | RTLD_LOCAL);
	cr_assert_not_null(h, "dlopen: %s", dlerror());
	uint32_t (*version)(void) = (uint32_t(*)(void))dlsym(h, "kvr_version_number");
	int (*init)(struct kvr_config *) = (int (*)(struct kvr_config *))dlsym(h, "kvr_config_init");
	int (*create)(const struct kvr_config *, struct kvr_context **) =
		(int (*)(const struct kvr_config *, struct kvr_context **))dlsym(h,
										"kvr_context_create");
	void (*destroy)(struct kvr_context *) =
		(void (*)(struct kvr_context *))dlsym(h, "kvr_context_destroy");
	cr_assert(version && init && create && destroy);
	cr_expect_eq(version(), KVR_VERSION_NUMBER);
	cr_expect_null(dlsym(h, "kvr_fail"), "internal helper is visible");
	cr_expect_null(dlsym(h, "cudaGetDeviceCount"), "cudart leaks out of the library");
	struct kvr_config c;
	init(&c);
	c.n_layers = 2;
	c.n_qo_heads = 4;
	c.n_kv_heads = 2;
	struct kvr_context *ctx = NULL;
	cr_expect_eq(create(&c, &ctx), 0);
	destroy(ctx);
	dlclose(h);
}
