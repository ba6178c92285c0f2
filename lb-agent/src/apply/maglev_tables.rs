//! The inner arrays of `lb_maglev` (issue 17): each Maglev table is an array map the agent creates
//! at the table's size, fills, and only then swaps into the outer map (`KernelMaps::put_maglev_tables`).
//!
//! The kernel accepts an inner map only if it matches the object's template (`MaglevTable` in
//! `lb-ebpf/src/maps.rs`): the same type, key and value sizes and flags (`BPF_F_INNER_MAP`, which
//! lets the size differ, and `BPF_F_RDONLY_PROG`), and on Linux 6.1 the same `timer_off`, which
//! a map created without BTF has as -EINVAL and one with BTF (the template) as -ENOENT. So each
//! inner array carries BTF too: a `u32` key and `struct lb_maglev_chunk { u32 backend_ids[256]; }`
//! (the layout of `lb_common::maglev::MaglevChunk`), loaded once. bpftool then dumps a table
//! with its field names as well.
//!
//! aya creates maps only from an object's definitions, or without BTF: the two syscalls here are
//! made directly, as the batch updates of `kernel.rs` are.

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use aya::maps::{Array, Map, MapData};
use lb_common::{
    catalog,
    maglev::{LANES, MaglevChunk},
};

use super::{
    kernel::{io_err, write_batch},
    ops::MapError,
};

/// The kernel's name of every table (at most 15 bytes).
const NAME: &[u8] = b"lb_maglev_tbl";
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_F_RDONLY_PROG: u32 = 1 << 7;
const BPF_F_INNER_MAP: u32 = 1 << 12;
/// The BTF type ids of the key (`unsigned int`) and the value (`struct lb_maglev_chunk`).
const KEY_TYPE: u32 = 1;
const VALUE_TYPE: u32 = 3;

/// Creates the inner arrays; loads their BTF at the first one.
#[derive(Default)]
pub struct InnerArrays {
    btf: Option<OwnedFd>,
}

impl InnerArrays {
    /// A table's inner array, created at its size and filled (one batch update where the kernel
    /// has it), not yet visible to any program.
    pub fn build(
        &mut self,
        positions: &[u32],
        batch_supported: &mut bool,
    ) -> Result<(Array<MapData, MaglevChunk>, RawFd), MapError> {
        let err = |op: &'static str| move |e: io::Error| MapError::new(catalog::MAGLEV, op, e);
        if self.btf.is_none() {
            self.btf = Some(load_btf().map_err(err("load BTF for"))?);
        }
        let btf = self.btf.as_ref().expect("loaded above");
        let chunks: Vec<(u32, MaglevChunk)> = positions
            .chunks(LANES)
            .enumerate()
            .map(|(i, ids)| {
                let mut chunk = MaglevChunk::default();
                chunk.backend_ids[..ids.len()].copy_from_slice(ids);
                (i as u32, chunk)
            })
            .collect();
        let fd = create_array(btf, (chunks.len() as u32).max(1)).map_err(err("create"))?;
        let raw = fd.as_raw_fd();
        let data = MapData::from_fd(fd).map_err(|e| err("create")(io_err(e)))?;
        let mut inner: Array<MapData, MaglevChunk> = Map::Array(data)
            .try_into()
            .map_err(|e| err("create")(io_err(e)))?;
        // `raw` stays valid while `inner` holds the map.
        write_batch(raw, batch_supported, &chunks, |i, chunk| {
            inner
                .set(*i, chunk, 0)
                .map_err(|e| MapError::new(catalog::MAGLEV, "update", io_err(e)))
        })
        .map_err(|e| e.error)?;
        Ok((inner, raw))
    }
}

/// The BTF blob: header, three types, their names.
fn btf_blob() -> Vec<u8> {
    const BTF_KIND_INT: u32 = 1;
    const BTF_KIND_ARRAY: u32 = 3;
    const BTF_KIND_STRUCT: u32 = 4;
    let strings = b"\0unsigned int\0lb_maglev_chunk\0backend_ids\0";
    let (int_name, struct_name, member_name) = (1u32, 14u32, 30u32);
    let words: [u32; 16] = [
        // [1] INT "unsigned int": 4 bytes, 32 bits, unsigned.
        int_name,
        BTF_KIND_INT << 24,
        4,
        32,
        // [2] ARRAY of LANES [1], indexed by [1].
        0,
        BTF_KIND_ARRAY << 24,
        0,
        KEY_TYPE,
        KEY_TYPE,
        LANES as u32,
        // [3] STRUCT "lb_maglev_chunk", one member "backend_ids" of type [2] at bit 0.
        struct_name,
        (BTF_KIND_STRUCT << 24) | 1,
        size_of::<MaglevChunk>() as u32,
        member_name,
        2,
        0,
    ];
    let types: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let mut blob = Vec::new();
    blob.extend_from_slice(&0xEB9Fu16.to_ne_bytes()); // magic
    blob.extend_from_slice(&[1, 0]); // version, flags
    for word in [
        24u32,
        0,
        types.len() as u32,
        types.len() as u32,
        strings.len() as u32,
    ] {
        // hdr_len, type_off, type_len, str_off, str_len
        blob.extend_from_slice(&word.to_ne_bytes());
    }
    blob.extend_from_slice(&types);
    blob.extend_from_slice(strings);
    blob
}

/// `union bpf_attr` for BPF_BTF_LOAD. No implicit padding: the kernel refuses an attribute whose
/// bytes past the fields it knows are not zero (6.1 ends at `btf_log_level`), and padding bytes
/// are not zeroed by Rust.
#[repr(C)]
#[derive(Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    /// `btf_log_true_size` on 6.4 and later (written by the kernel); zero.
    _tail: u32,
}

/// `union bpf_attr` for BPF_MAP_CREATE, up to the fields used.
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
    map_ifindex: u32,
    btf_fd: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
    btf_vmlinux_value_type_id: u32,
}

/// bpf(2) with a command whose answer is a new file descriptor.
///
/// # Safety
/// `attr` is the command's attribute layout, its pointers valid for the call.
unsafe fn bpf_fd<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    // SAFETY: the caller's promise.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

fn load_btf() -> io::Result<OwnedFd> {
    let blob = btf_blob();
    let mut attr = BtfLoadAttr {
        btf: blob.as_ptr() as u64,
        btf_size: blob.len() as u32,
        ..Default::default()
    };
    // SAFETY: BtfLoadAttr is BPF_BTF_LOAD's layout; `blob` lives through the call.
    unsafe { bpf_fd(BPF_BTF_LOAD, &mut attr) }
}

fn create_array(btf: &OwnedFd, max_entries: u32) -> io::Result<OwnedFd> {
    let mut map_name = [0u8; 16];
    map_name[..NAME.len()].copy_from_slice(NAME);
    let mut attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_ARRAY,
        key_size: size_of::<u32>() as u32,
        value_size: size_of::<MaglevChunk>() as u32,
        max_entries,
        map_flags: BPF_F_INNER_MAP | BPF_F_RDONLY_PROG,
        map_name,
        btf_fd: btf.as_fd().as_raw_fd() as u32,
        btf_key_type_id: KEY_TYPE,
        btf_value_type_id: VALUE_TYPE,
        ..Default::default()
    };
    // SAFETY: MapCreateAttr is BPF_MAP_CREATE's layout; it holds no pointer.
    unsafe { bpf_fd(BPF_MAP_CREATE, &mut attr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blob's layout: a 24-byte header, 64 bytes of types, the names; each name where the
    /// types say it is.
    #[test]
    fn the_btf_blob_names_each_type() {
        let blob = btf_blob();
        assert_eq!(&blob[..2], &0xEB9Fu16.to_ne_bytes());
        let word = |at: usize| u32::from_ne_bytes(blob[at..at + 4].try_into().unwrap());
        assert_eq!((word(4), word(12), word(16)), (24, 64, 64));
        let strings = &blob[24 + 64..];
        let name = |off: u32| {
            let s = &strings[off as usize..];
            std::str::from_utf8(&s[..s.iter().position(|b| *b == 0).unwrap()])
                .unwrap()
                .to_string()
        };
        assert_eq!(name(word(24)), "unsigned int");
        assert_eq!(name(word(24 + 16 + 24)), "lb_maglev_chunk");
        assert_eq!(name(word(24 + 16 + 24 + 12)), "backend_ids");
        assert_eq!(size_of::<MapCreateAttr>(), 64);
        assert_eq!(size_of::<BtfLoadAttr>(), 32);
    }
}
