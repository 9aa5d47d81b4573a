//! A structural check of a plugin file before it is handed to `dlopen`.
//!
//! `dlopen` maps a shared object's `PT_LOAD` segments straight from the file. A
//! truncated file maps pages past its end, and the first touch of one kills the
//! process with SIGBUS — no error, no recovery. So before any dlopen we parse the
//! ELF headers and make sure every loadable segment lies inside the file, along
//! with the cheaper checks that give a clearer message than the dynamic linker
//! (not ELF at all, another architecture, an executable rather than a library).

use object::elf;
use object::read::elf::{FileHeader, ProgramHeader};
use object::{Endianness, ReadRef};

/// What is wrong with a file that should be a shared object.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ElfError {
    #[error("it is not an ELF shared object (it starts with {0:02x?}); a plugin is the `lib<name>.so` that `cargo build` puts in target/<profile>/")]
    NotElf(Vec<u8>),
    #[error("it is a 32-bit ELF file; this router is 64-bit, so build the plugin for the same target as the router")]
    Not64Bit,
    #[error("it is built for another machine (ELF machine {found}, this router needs {expected}); build the plugin for the router's target")]
    WrongMachine { found: u16, expected: u16 },
    #[error("it is an ELF file of type {0}, not a shared library (ET_DYN); build the plugin crate with `crate-type = [\"cdylib\"]`")]
    NotSharedObject(u16),
    #[error("its ELF headers are damaged or cut short ({0}); the file is truncated or corrupt: copy it again from the build")]
    Corrupt(String),
    #[error("it is truncated: loadable segment {index} ends at byte {end}, but the file has {len} bytes; copy it again from the build (write to a temporary name, then rename)")]
    Truncated { index: usize, end: u64, len: u64 },
}

#[cfg(target_arch = "x86_64")]
const HOST_MACHINE: u16 = elf::EM_X86_64;
#[cfg(target_arch = "aarch64")]
const HOST_MACHINE: u16 = elf::EM_AARCH64;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const HOST_MACHINE: u16 = elf::EM_NONE;

/// How many leading bytes [`check_header`] looks at.
pub const HEADER_BYTES: usize = 5;

/// The cheap check on a file's first bytes, before anything else of it is
/// read: the ELF magic and the 64-bit class.
pub fn check_header(first: &[u8]) -> Result<(), ElfError> {
    if first.len() < 4 || &first[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf(first.iter().take(4).copied().collect()));
    }
    if first.get(4) != Some(&elf::ELFCLASS64) {
        return Err(ElfError::Not64Bit);
    }
    Ok(())
}

/// Checks that `bytes` is a 64-bit ELF shared object for this machine whose
/// loadable segments all lie within the file.
pub fn check_shared_object(bytes: &[u8]) -> Result<(), ElfError> {
    check_data(bytes, bytes.len() as u64)
}

/// [`check_shared_object`] of a file of `len` bytes, reading only its headers
/// (the ELF header, the program and section header tables, the section names),
/// not the whole file.
pub fn check_file(file: &std::fs::File, len: u64) -> Result<(), ElfError> {
    let cache = object::read::ReadCache::new(file);
    check_data(&cache, len)
}

fn check_data<'data, R: ReadRef<'data>>(data: R, len: u64) -> Result<(), ElfError> {
    let first = data
        .read_bytes_at(0, (HEADER_BYTES as u64).min(len))
        .unwrap_or(&[]);
    check_header(first)?;
    let header = elf::FileHeader64::<Endianness>::parse(data)
        .map_err(|e| ElfError::Corrupt(e.to_string()))?;
    let endian = header
        .endian()
        .map_err(|e| ElfError::Corrupt(e.to_string()))?;
    let machine = header.e_machine(endian);
    if HOST_MACHINE != elf::EM_NONE && machine != HOST_MACHINE {
        return Err(ElfError::WrongMachine {
            found: machine,
            expected: HOST_MACHINE,
        });
    }
    let kind = header.e_type(endian);
    if kind != elf::ET_DYN {
        return Err(ElfError::NotSharedObject(kind));
    }
    let segments = header
        .program_headers(endian, data)
        .map_err(|e| ElfError::Corrupt(e.to_string()))?;
    for (index, segment) in segments.iter().enumerate() {
        if segment.p_type(endian) != elf::PT_LOAD {
            continue;
        }
        let end = segment
            .p_offset(endian)
            .checked_add(segment.p_filesz(endian))
            .ok_or_else(|| ElfError::Corrupt(format!("segment {index} overflows")))?;
        if end > len {
            return Err(ElfError::Truncated { index, end, len });
        }
    }
    // The section headers are not used by dlopen, but a file whose table lies
    // past its end was cut short too.
    if let Err(e) = header.sections(endian, data) {
        return Err(ElfError::Corrupt(e.to_string()));
    }
    Ok(())
}

/// The names in the file's dynamic symbol table that start with `prefix`
/// (defined symbols only), read from its headers and that table alone.
pub fn dynamic_symbols_with_prefix(
    file: &std::fs::File,
    prefix: &str,
) -> Result<Vec<String>, ElfError> {
    let cache = object::read::ReadCache::new(file);
    let data = &cache;
    let corrupt = |e: object::read::Error| ElfError::Corrupt(e.to_string());
    let header = elf::FileHeader64::<Endianness>::parse(data).map_err(corrupt)?;
    let endian = header.endian().map_err(corrupt)?;
    let sections = header.sections(endian, data).map_err(corrupt)?;
    let symbols = sections
        .symbols(endian, data, elf::SHT_DYNSYM)
        .map_err(corrupt)?;
    let mut found = Vec::new();
    for symbol in symbols.iter() {
        use object::read::elf::Sym;
        if symbol.st_shndx(endian) == elf::SHN_UNDEF {
            continue;
        }
        let Ok(name) = symbol.name(endian, symbols.strings()) else {
            continue;
        };
        if let Some(name) = std::str::from_utf8(name)
            .ok()
            .filter(|n| n.starts_with(prefix))
        {
            found.push(name.to_string());
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn this_executable() -> Vec<u8> {
        // The test binary is a PIE, i.e. ET_DYN, with real PT_LOAD segments.
        std::fs::read(std::env::current_exe().unwrap()).unwrap()
    }

    #[test]
    fn a_real_shared_object_passes() {
        let bytes = this_executable();
        // A PIE executable is ET_DYN; if the toolchain ever makes non-PIE test
        // binaries, this says so instead of passing vacuously.
        assert_eq!(check_shared_object(&bytes), Ok(()));
    }

    #[test]
    fn text_is_not_elf() {
        assert!(matches!(
            check_shared_object(b"#!/bin/sh\necho hi\n"),
            Err(ElfError::NotElf(_))
        ));
    }

    #[test]
    fn a_file_is_checked_from_its_headers_alone() {
        let path = std::env::current_exe().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        assert_eq!(check_file(&file, len), Ok(()));
        // The same file said to be cut short: its segments no longer fit.
        assert!(matches!(
            check_file(&file, 8192),
            Err(ElfError::Truncated { .. })
        ));
        assert_eq!(check_header(b"\x7fELF\x01"), Err(ElfError::Not64Bit));
    }

    #[test]
    fn truncation_is_caught_before_dlopen() {
        let bytes = this_executable();
        let cut = &bytes[..bytes.len() / 2];
        assert!(matches!(
            check_shared_object(cut),
            Err(ElfError::Truncated { .. }) | Err(ElfError::Corrupt(_))
        ));
    }
}
