//! Just enough of ELF to pack a Debian program into the initramfs with the
//! shared libraries it needs: its program interpreter (`PT_INTERP`) and
//! the `DT_NEEDED` entries of its dynamic section. The host's `ldd` cannot
//! do this for the guest tree's programs: it would run them with the host's
//! loader and libraries (Debian 12's glibc is older than trixie's).

/// What a dynamically linked ELF file asks of the loader.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dynamic {
    /// The program interpreter (`/lib64/ld-linux-x86-64.so.2`); none for a
    /// shared library.
    pub interp: Option<String>,
    /// The sonames of `DT_NEEDED`, in order.
    pub needed: Vec<String>,
}

/// Why an ELF file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    #[error("Not a 64-bit little-endian ELF file")]
    NotElf64,
    #[error("Truncated at {0}")]
    Truncated(&'static str),
    #[error("The dynamic string table lies outside every loaded segment")]
    NoStringTable,
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;

fn bytes<'a>(data: &'a [u8], at: u64, len: u64, what: &'static str) -> Result<&'a [u8], ElfError> {
    let start = usize::try_from(at).map_err(|_| ElfError::Truncated(what))?;
    let len = usize::try_from(len).map_err(|_| ElfError::Truncated(what))?;
    start
        .checked_add(len)
        .and_then(|end| data.get(start..end))
        .ok_or(ElfError::Truncated(what))
}

fn u16_at(data: &[u8], at: u64, what: &'static str) -> Result<u16, ElfError> {
    let b = bytes(data, at, 2, what)?;
    Ok(u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(data: &[u8], at: u64, what: &'static str) -> Result<u32, ElfError> {
    let mut v = [0u8; 4];
    v.copy_from_slice(bytes(data, at, 4, what)?);
    Ok(u32::from_le_bytes(v))
}

fn u64_at(data: &[u8], at: u64, what: &'static str) -> Result<u64, ElfError> {
    let mut v = [0u8; 8];
    v.copy_from_slice(bytes(data, at, 8, what)?);
    Ok(u64::from_le_bytes(v))
}

/// A NUL-terminated string at `at`.
fn c_str(data: &[u8], at: u64, what: &'static str) -> Result<String, ElfError> {
    let start = usize::try_from(at).map_err(|_| ElfError::Truncated(what))?;
    let rest = data.get(start..).ok_or(ElfError::Truncated(what))?;
    let end = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or(ElfError::Truncated(what))?;
    Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// Whether `data` starts like an ELF file (a shell script does not).
pub fn is_elf(data: &[u8]) -> bool {
    data.starts_with(b"\x7fELF")
}

/// Reads the interpreter and the needed libraries of a 64-bit
/// little-endian ELF file. A static file gives an empty [`Dynamic`].
pub fn dynamic(data: &[u8]) -> Result<Dynamic, ElfError> {
    if !is_elf(data) || data.get(4) != Some(&2) || data.get(5) != Some(&1) {
        return Err(ElfError::NotElf64);
    }
    let phoff = u64_at(data, 0x20, "the ELF header")?;
    let phentsize = u64::from(u16_at(data, 0x36, "the ELF header")?);
    let phnum = u64::from(u16_at(data, 0x38, "the ELF header")?);
    // (type, offset, vaddr, filesz) of every program header.
    let mut headers = Vec::new();
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        headers.push((
            u32_at(data, at, "a program header")?,
            u64_at(data, at + 8, "a program header")?,
            u64_at(data, at + 16, "a program header")?,
            u64_at(data, at + 32, "a program header")?,
        ));
    }
    let mut out = Dynamic::default();
    if let Some(&(_, offset, _, _)) = headers.iter().find(|h| h.0 == PT_INTERP) {
        out.interp = Some(c_str(data, offset, "the interpreter")?);
    }
    let Some(&(_, dyn_off, _, dyn_size)) = headers.iter().find(|h| h.0 == PT_DYNAMIC) else {
        return Ok(out);
    };
    let mut strtab = None;
    let mut needed = Vec::new();
    for i in 0..dyn_size / 16 {
        let tag = u64_at(data, dyn_off + i * 16, "the dynamic section")?;
        let val = u64_at(data, dyn_off + i * 16 + 8, "the dynamic section")?;
        match tag {
            DT_NULL => break,
            DT_NEEDED => needed.push(val),
            DT_STRTAB => strtab = Some(val),
            _ => {}
        }
    }
    if needed.is_empty() {
        return Ok(out);
    }
    // DT_STRTAB is an address: find the file offset of the loaded segment
    // holding it.
    let vaddr = strtab.ok_or(ElfError::NoStringTable)?;
    let table = headers
        .iter()
        .filter(|h| h.0 == PT_LOAD)
        .find(|&&(_, _, seg_vaddr, filesz)| vaddr >= seg_vaddr && vaddr < seg_vaddr + filesz)
        .map(|&(_, offset, seg_vaddr, _)| vaddr - seg_vaddr + offset)
        .ok_or(ElfError::NoStringTable)?;
    for name in needed {
        out.needed
            .push(c_str(data, table + name, "a needed library's name")?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_interpreter_and_libraries_of_a_host_program() {
        // /bin/sh of any Debian: dynamically linked against libc.
        let data = std::fs::read("/bin/sh").expect("/bin/sh");
        let d = dynamic(&data).expect("ELF");
        assert_eq!(
            d.interp.as_deref(),
            Some("/lib64/ld-linux-x86-64.so.2"),
            "{d:?}"
        );
        assert!(d.needed.iter().any(|n| n == "libc.so.6"), "{d:?}");
    }

    #[test]
    fn rejects_what_is_not_elf() {
        assert_eq!(dynamic(b"#!/bin/sh\n"), Err(ElfError::NotElf64));
        assert!(matches!(
            dynamic(b"\x7fELF\x02\x01"),
            Err(ElfError::Truncated(_))
        ));
    }
}
